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


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_profile_runs_here_on_the_tiny_model(tiny_model_dir, capsys):
    """scripts/gpu_profile.py (gpu_check.sh's profile phase) on the CPU: device time is too scarce to find a broken
    script there. The profiler, started on the scheduler thread, sees the loop's ops on free text and under a schema."""
    profile = _script("gpu_profile")
    for extra in ([], ["--json"]):
        rows = profile.main(["--device", "cpu", "--dtype", "float32", "--model-path", str(tiny_model_dir),
                             "--algorithms", "none", "NGRAM", "--max-new-tokens", "6", "--top", "3", *extra])
        assert [r["algorithm"] for r in rows] == ["none", "NGRAM"]
        assert all(r["iterations"] >= 1 and r["aten_calls_per_iteration"] > 0 for r in rows), rows
    out = capsys.readouterr().out
    assert "## none (text)" in out and "## NGRAM (json)" in out


def test_the_host_probe_runs_here(capsys):
    _script("gpu_host_probe").main()
    report = capsys.readouterr().out
    assert report.startswith("host probe: ") and '"python_loop_1e6_ms"' in report
