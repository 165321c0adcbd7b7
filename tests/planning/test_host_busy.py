"""k3train/planning/calibration/host_busy.py and tools/plan.py's rule for a calibration taken beside other work: other
processes' CPU is seen (a busy process that is not ours), and a calibration disturbed by it is put back as it was,
while an undisturbed one is kept with its conditions recorded."""
import json
import os
import signal
import subprocess
import sys
import time

from k3train.planning.calibration.host import host_key
from k3train.planning.calibration.host_busy import IDLE_OTHERS_CORES, OthersCpu, own_cpu_seconds
from tools.plan import _keep_calibration


_SPIN = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"


def test_a_busy_process_that_is_not_ours_is_counted() -> None:
    # started through a launcher that exits at once: the spinning process is not a descendant of this one
    launcher = subprocess.run([sys.executable, "-c", "import subprocess as s, sys; print(s.Popen([sys.executable, "
                               f"'-c', {_SPIN!r}], start_new_session=True, stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"],
                              capture_output=True, text=True, check=True)
    hog = int(launcher.stdout)
    try:
        time.sleep(0.3)  # the interpreter is up and spinning
        others = OthersCpu()
        time.sleep(1.5)
        seen = others.cores()
    finally:
        os.kill(hog, signal.SIGKILL)
    # the spinning process takes about one of the cores (at least its share beside anything else running)
    assert seen > IDLE_OTHERS_CORES, seen


def test_a_live_descendant_is_our_own() -> None:
    """A child not waited for yet (as the ranks of a fork server that lives as long as the planner) is this
    process's work: its CPU time counts as ours while it runs, not as another process's."""
    before = own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 1.0: pass\n"
                              "print('spun', flush=True)\ntime.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        assert own_cpu_seconds() - before >= 0.95
    finally:
        child.kill()
        child.wait()


class _Seen:
    """What OthersCpu reported over the calibration (the measurement itself is tested above)."""

    def __init__(self, cores: float) -> None:
        self._cores = cores

    def cores(self) -> float:
        return self._cores

    def wall_s(self) -> float:
        return 12.0


def test_a_disturbed_calibration_is_put_back_and_a_clean_one_kept(tmp_path) -> None:
    path = tmp_path / "cal.json"
    assert _keep_calibration(path, None, _Seen(0.9), None) is None  # nothing calibrated: nothing said
    path.write_text('{"old": 1}')
    before = path.read_bytes()
    path.write_text('{"old": 1, "new": 2}')  # what this run measured
    note = _keep_calibration(path, before, _Seen(0.9), None)
    assert note.startswith("CALIBRATION DISCARDED") and "0.90 cores" in note
    assert path.read_bytes() == before
    path.write_text('{"new": 2}')
    assert "DISCARDED" in _keep_calibration(path, None, _Seen(0.9), None) and not path.exists()
    path.write_text('{"new": 2}')
    note = _keep_calibration(path, None, _Seen(0.1), None)
    assert "0.10 cores" in note and "DISCARDED" not in note
    data = json.loads(path.read_text())
    assert data["new"] == 2 and data[host_key(1)]["calibrated"][-1]["others_cores"] == 0.1
