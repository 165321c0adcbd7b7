"""The suite's own guard (tests/user_state.py, run by conftest.py around the whole session) sees what a test
adds, removes or rewrites under the guarded directories."""
from user_state import UserStateGuard


def test_guard_names_added_removed_and_rewritten(tmp_path):
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    keep, gone = tmp_path / "runs" / "tiny" / "metrics.jsonl", tmp_path / "runs" / "tiny" / "config.yaml"
    keep.write_text("a\n")
    gone.write_text("b\n")
    g = UserStateGuard([tmp_path / "runs", tmp_path / "missing"])
    g.start()
    assert g.changes() == []
    keep.write_text("a\nb\n")
    gone.unlink()
    (tmp_path / "missing").mkdir()
    assert g.changes() == [f"added {tmp_path / 'missing'}", f"removed {gone}", f"rewritten {keep}"]
