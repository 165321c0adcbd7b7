import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the measured MFU denominator is cached per host (k3train/metrics.py): the suite's runs, taken under its load,
# must not become the user's cached peak
os.environ.setdefault("K3TRAIN_CACHE_DIR", tempfile.mkdtemp(prefix="k3train-test-cache-"))

# Property tests are derandomized (examples drawn from a seed fixed per test) so CI cannot flake on a lucky draw;
# deadline=None because 2 shared CPU cores make per-example timing meaningless. HYPOTHESIS_PROFILE=explore runs
# random examples locally to look for new counterexamples.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
