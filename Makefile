# The two quickstart commands. Each one installs what it needs into .venv first.
.PHONY: run test bench setup

run:
	@./scripts/setup.sh test
	.venv/bin/kvgen compile --model llama-3-70b --target h100 --kv int4

test:
	@./scripts/setup.sh test
	.venv/bin/python -m pytest -q -rs -n 2 -p no:cacheprovider

bench:
	@./scripts/setup.sh test,bench
	.venv/bin/python -m benchmarks.run
