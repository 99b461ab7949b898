# Two commands from a fresh clone:
#   make demo   -> set up and launch the app on the default model (http://127.0.0.1:7860)
#   make test   -> set up and run lint + the whole test suite
.PHONY: demo test setup bench parity clean

demo:
	scripts/setup.sh
	.venv/bin/python app.py

test:
	scripts/setup.sh --dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -rs

bench:
	scripts/setup.sh
	.venv/bin/python -m engine bench

parity:
	scripts/setup.sh
	.venv/bin/python -m engine parity

clean:
	rm -rf .venv artifacts .pytest_cache .ruff_cache
