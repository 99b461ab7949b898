# Two commands from a fresh clone:
#   make demo       -> set up and launch the app on the default model (http://127.0.0.1:7860)
#   make test       -> set up and run lint + the whole test suite
# The inner loop while developing:
#   make test-fast  -> lint + every test that needs no real model weights, no browser and no vLLM
.PHONY: demo test test-fast setup bench parity clean

demo:
	scripts/setup.sh
	.venv/bin/python app.py

test:
	scripts/setup.sh --dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -rs --durations=25

test-fast:
	scripts/setup.sh --fast
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -m "not slow and not real_model and not browser and not vllm" --durations=10

bench:
	scripts/setup.sh
	.venv/bin/python -m engine bench

parity:
	scripts/setup.sh
	.venv/bin/python -m engine parity

clean:
	rm -rf .venv artifacts .pytest_cache .ruff_cache
