# The two commands a newcomer runs (see README): `make demo` and `make test`.
.PHONY: setup demo test bench-latency

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m specjet.demo

# --max-worker-restart=1: after a test kills its worker (a signal in native code), xdist 3.8's
# loadfile scheduling with the default restarts can wait for ever; one restart ends the run, failed.
test: setup
	.venv/bin/python -m pytest -q -n auto --dist loadfile --max-worker-restart=1 tests

bench-latency: setup
	.venv/bin/python -m bench.latency
