# The two commands a newcomer runs (see README): `make demo` and `make test`.
.PHONY: setup demo test bench-latency

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m specjet.demo

test: setup
	.venv/bin/python -m pytest -q -n auto --dist loadfile tests

bench-latency: setup
	.venv/bin/python -m bench.latency
