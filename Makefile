# The two commands: `make serve` and `make test`. Both build .venv/ from the project's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv serve test offline bench-engine clean

$(BIN)/.installed: pyproject.toml requirements/cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements/cpu.txt
	$(BIN)/pip install -c requirements/cpu.txt -e '.[test,bench]'
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q

serve: venv
	$(BIN)/kvserve up

offline: venv
	$(BIN)/kvserve offline --model tiny --prompt "The KV cache is" --max-tokens 32

bench-engine: venv
	$(BIN)/python -m loadtest.bench_engine

clean:
	rm -rf $(VENV) results
