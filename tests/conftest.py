import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite never reads or writes the user's state: the checkout's run directories, the built corpora in
# data_cache/ (beyond reading the shipped ones through private views, shipped_data.py), and the user's
# ~/.cache/k3train (the measured MFU denominator and the planner's calibration, cached per host: the suite's
# runs, taken under its load, must not become them, and a user's cache must not steer the suite's results).
# A user's exported K3TRAIN_CACHE_DIR is replaced too. user_state_guard below checks the first and last.
_USER_CACHE = [Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3train"]
if os.environ.get("K3TRAIN_CACHE_DIR"):
    _USER_CACHE.append(Path(os.environ["K3TRAIN_CACHE_DIR"]))
os.environ["K3TRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3train-test-cache-")
os.environ["K3TRAIN_TEST_DATA_VIEWS"] = tempfile.mkdtemp(prefix="k3train-test-data-")

# Property tests are derandomized (examples drawn from a seed fixed per test) so CI cannot flake on a lucky draw;
# deadline=None because 2 shared CPU cores make per-example timing meaningless. HYPOTHESIS_PROFILE=explore runs
# random examples locally to look for new counterexamples.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


from user_state import UserStateGuard  # noqa: E402

_guard = UserStateGuard([ROOT / "runs", ROOT / "data_cache", *_USER_CACHE])


def pytest_sessionstart(session):
    _guard.start()


def pytest_sessionfinish(session, exitstatus):
    changed = _guard.changes()
    if changed:
        session.exitstatus = 1
        print("\nthe test suite changed the user's state (it must only use its own temporary directories):\n  "
              + "\n  ".join(changed), file=sys.stderr)
