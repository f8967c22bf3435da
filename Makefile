# Two commands on a fresh machine (see README):
#   make demo   -> the main job: tiny CPU end-to-end PDM RL run (TP=2, 2 processes)
#   make test   -> the whole CPU test suite
# Each creates .venv and installs what it needs on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
NPROC   ?= 2

.PHONY: demo test bench venv clean

$(STAMP): setup.py constraints/ci.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints/ci.txt -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node $(NPROC) --master-port $${MASTER_PORT:-29517} \
		-m megatron_pdm.train --config examples/tiny_cpu/config.yaml $(ARGS)

test: $(STAMP)
	$(VPY) -m pytest -q -m "not gpu" tests $(ARGS)

bench: $(STAMP)
	$(VPY) benchmarks/bench_op.py
	$(VPY) benchmarks/bench_parse.py

clean:
	rm -rf $(VENV) runs .pytest_cache
