"""scripts/gpu_check.sh runs on a lent GPU machine, where device time is scarce: a test file it names
that no longer exists would stop its one pytest run at collection, so every name must be a file."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_test_file_the_gpu_check_names_exists():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    match = re.search(r'files=\$\{TEST_FILES:-"([^"]+)"\}', script)
    assert match, "gpu_check.sh no longer lists its default test files as files=${TEST_FILES:-\"...\"}"
    names = match.group(1).split()
    assert len(names) > 20
    missing = [n for n in names if not (ROOT / "tests" / f"{n}.py").is_file()]
    assert not missing, f"gpu_check.sh names test files that do not exist: {missing}"
