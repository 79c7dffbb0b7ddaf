# make install   create .venv and install the suite (torch first: TORCH_SPEC picks the build)
# make bench     run a matrix (MATRIX=smoke by default) and write results/<matrix>/
# make list      print a matrix's plan      make report   regenerate its leaderboard
# make test      CPU tests (all; CI)        make test-fast  the inner loop: no real worker processes
# make lint      ruff + mypy
# make fit       fit frontier: MATRIX=fit3b BUDGETS=24,40,80 (GPU)
# make scenarios  results/SCENARIOS.md: the field reports answered from the published tables
# make site     site/index.html: every published table as one page (filters, fits in N GiB, plots, detail)
# make predict   each cell's peak allocated GPU memory, predicted on this CPU (MATRIX=..)
# make predict-gate  the regress matrix predicted under VERSIONS, compared with PREDICT_BASELINE, and every stack once
#                    (coverage: does each still predict?) against PREDICT_COVERAGE_BASELINE; then each stack's fake run
#                    beside real CPU tensors on the tiny models (tools/fake_vs_real.py --stacks) (CPU only)
# make predict-architectures  every text causal-LM architecture of transformers asked about under VERSIONS
#                    (tools/model_types.py), failing if one the committed answers predicted no longer does; then each
#                    one predicted run on fake and on real CPU tensors (tools/fake_vs_real.py), failing if a pair
#                    the committed comparison found equal no longer is (CPU only)
# make regress   regress matrix (GPU) under VERSIONS, gated against REGRESS_BASELINE with `bench compare`
# make gpu-backlog  on one GPU host: every GPU run the published results still lack (resumable), raw rows tarred
# make gpu-window   the same for one window of a lent GPU: stops before BUDGET_S seconds, tars into $OUT
MATRIX ?= smoke
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY ?= $(shell test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo python3)
ARGS ?=
VERSIONS ?=
BUDGETS ?= 24,40,80
REGRESS_BASELINE ?= regress-h100-image-a
PREDICT_BASELINE ?= regress-predicted-h100-20261130c
# the version set (versions/NAME.txt) PREDICT_BASELINE was predicted under: a pull request is gated under it
PREDICT_BASELINE_VERSIONS ?= latest-2026-11-25
PREDICT_GATE_DIR ?= .predict-gate
PREDICT_GATE_RUN = regress-predicted-$(or $(VERSIONS),current)
# the coverage matrix's baseline: every stack predicted under PREDICT_BASELINE_VERSIONS
PREDICT_COVERAGE_BASELINE ?= coverage-predicted-h100-20261130
PREDICT_COVERAGE_RUN = coverage-predicted-$(or $(VERSIONS),current)
# the architectures' answers under PREDICT_BASELINE_VERSIONS (tools/model_types.py --out)
PREDICT_ARCHITECTURES_BASELINE ?= results/model-types/$(PREDICT_BASELINE_VERSIONS).json
PREDICT_FAKE_VS_REAL_BASELINE ?= results/model-types/$(PREDICT_BASELINE_VERSIONS)-fake-vs-real.json
# every stack of the coverage matrix on these tiny models, fake against real CPU tensors, under PREDICT_BASELINE_VERSIONS
PREDICT_STACKS_MODELS ?= tiny-llama,tiny-olmoe,tiny-qwen2,tiny-mistral
PREDICT_STACKS_FAKE_VS_REAL_BASELINE ?= results/coverage/$(PREDICT_BASELINE_VERSIONS)-fake-vs-real.json
JOBS ?= 2
# the suite on TEST_JOBS pytest-xdist workers, each process of it on one thread: half the suite is one-threaded
# Python (fake tensors) or waits on a child (timeouts, torchrun), so two workers keep both cores busy where one left
# one idle (42 min -> 26 min on 2 cores, 2026-12-02: README); a test's own processes get no second thread to contend for
TEST_JOBS ?= 2
REGRESS_PY = $(if $(VERSIONS),.venv-$(VERSIONS)/bin/python,$(PY))
REGRESS_RUN := regress-$(or $(VERSIONS),current)-$(shell date -u +%Y%m%d-%H%M%S)
# the published run gpu-backlog adds to (an H100 80GB's); name another on another kind of GPU
LLAMA3B_RUN ?= llama3b-h100-20261122
UNSLOTH ?= 2026.10.9
BUDGET_S ?= 540

.PHONY: install bench list report scenarios site fit predict predict-gate predict-architectures test test-fast test-gpu lint versions-env regress regress-benchmark gpu-backlog gpu-window

install:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[dev,plots,bnb,liger,torchao,lowrank,cce]"
	# Unsloth (the `unsloth` peer stack) without its declared dependencies: they would pull a CUDA torch
	# (torchvision, xformers) and pin transformers; what its import needs beyond ours is requests
	$(VENV)/bin/python -m pip install -q --no-deps "unsloth==$(UNSLOTH)" "unsloth_zoo==$(UNSLOTH)" requests urllib3 certifi
	# DeepSpeed is source-only on PyPI: built against the torch above, its ops JIT-built when used
	DS_BUILD_OPS=0 $(VENV)/bin/python -m pip install -q --no-build-isolation "deepspeed>=0.16"
# ... except the CPU communication op DeepSpeed builds on first use on a CPU: built now, once, so no cell
# waits on a build (or on the lock of a build that was killed); harmless where it cannot build
	-$(VENV)/bin/python -c "from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder as B; B().load()" >/dev/null 2>&1

bench:
	$(PY) -m bench run $(MATRIX) $(ARGS)

list:
	$(PY) -m bench list $(MATRIX)

report:
	$(PY) -m bench report $(MATRIX)

fit:  # largest batch / sequence per stack under each memory budget (GiB), e.g. make fit MATRIX=fit3b
	$(PY) -m bench fit $(MATRIX) --budgets $(BUDGETS) $(ARGS)

predict:
	$(PY) -m bench predict $(MATRIX) $(ARGS)

scenarios:
	$(PY) -m bench scenarios

site:
	$(PY) -m bench site

predict-gate:  # a torch / transformers / peft release that changes training memory, caught on a CPU
	$(REGRESS_PY) -m bench --results-dir $(PREDICT_GATE_DIR) predict regress --run-id $(PREDICT_GATE_RUN) --redo $(ARGS)
	# then every stack once: does each stack's prediction still run under these releases? (status gated; moves
	# shown); and does each stack's fake run still count what its real CPU step counts, on the tiny models? (gated on
	# the pairs equal under the baseline's releases). Every gate runs and reports whatever the others say (a release
	# that moves the regress cells may also break a stack); the target fails if any does
	status=0; \
	$(REGRESS_PY) -m bench compare results/regress/predicted/$(PREDICT_BASELINE).parquet \
		$(PREDICT_GATE_DIR)/regress/predicted/$(PREDICT_GATE_RUN).parquet \
		--out results/regress/compare/$(PREDICT_BASELINE)_vs_$(PREDICT_GATE_RUN).md || status=1; \
	$(REGRESS_PY) -m bench --results-dir $(PREDICT_GATE_DIR) predict coverage --run-id $(PREDICT_COVERAGE_RUN) --redo --jobs 2 $(ARGS) \
	&& $(REGRESS_PY) -m bench compare results/coverage/predicted/$(PREDICT_COVERAGE_BASELINE).parquet \
		$(PREDICT_GATE_DIR)/coverage/predicted/$(PREDICT_COVERAGE_RUN).parquet --status-only \
		--out results/coverage/compare/$(PREDICT_COVERAGE_BASELINE)_vs_$(PREDICT_COVERAGE_RUN).md || status=1; \
	$(REGRESS_PY) tools/fake_vs_real.py --stacks coverage --models $(PREDICT_STACKS_MODELS) --jobs $(JOBS) \
		--baseline $(PREDICT_STACKS_FAKE_VS_REAL_BASELINE) \
		--out $(PREDICT_GATE_DIR)/coverage/fake-vs-real-$(or $(VERSIONS),current).md || status=1; \
	if [ $$status -ne 0 ]; then echo "predict-gate: FAIL (the reports above say which gate)" >&2; fi; \
	exit $$status

predict-architectures:  # a release that stops an architecture's prediction, or moves what it counts, caught first
	status=0; out=$(PREDICT_GATE_DIR)/model-types/$(or $(VERSIONS),current); \
	$(REGRESS_PY) tools/model_types.py --jobs $(JOBS) --baseline $(PREDICT_ARCHITECTURES_BASELINE) --out $$out.md \
		|| status=1; \
	$(REGRESS_PY) tools/fake_vs_real.py $$out.json --jobs $(JOBS) --baseline $(PREDICT_FAKE_VS_REAL_BASELINE) \
		--out $$out-fake-vs-real.md || status=1; \
	exit $$status

test:
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal

test-fast:
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "not slow and not gpu"

test-gpu:
	$(PY) -m pytest -q -m gpu tests/test_gpu.py  # the file alone: a GPU image lacks the dev-only packages (hypothesis) other test files import

lint:
	$(PY) -m ruff check bench tests benchmarks
	$(PY) -m mypy bench

versions-env:
	test -n "$(VERSIONS)" && test -f versions/$(VERSIONS).txt
	python3 -m venv .venv-$(VERSIONS)
	.venv-$(VERSIONS)/bin/python -m pip install -q --upgrade pip
	.venv-$(VERSIONS)/bin/python -m pip install -q -c versions/$(VERSIONS).txt torch
	# every package a stack needs, as `make install` has them: without one, its cells are predicted `unsupported`
	.venv-$(VERSIONS)/bin/python -m pip install -q -c versions/$(VERSIONS).txt -e ".[dev,bnb,liger,torchao,lowrank,cce]"
	.venv-$(VERSIONS)/bin/python -m pip install -q --no-deps "unsloth==$(UNSLOTH)" "unsloth_zoo==$(UNSLOTH)" requests urllib3 certifi
	DS_BUILD_OPS=0 .venv-$(VERSIONS)/bin/python -m pip install -q --no-build-isolation -c versions/$(VERSIONS).txt "deepspeed>=0.16"

regress:
	$(REGRESS_PY) -m bench run regress --run-id $(REGRESS_RUN) $(ARGS)
	$(REGRESS_PY) -m bench compare $(REGRESS_BASELINE) $(REGRESS_RUN) --out results/regress/compare/$(REGRESS_BASELINE)_vs_$(REGRESS_RUN).md

regress-benchmark:  # pytest-benchmark view: regress on a GPU (smoke on CPU), saved under .benchmarks/
	$(REGRESS_PY) -m pytest benchmarks --benchmark-autosave $(ARGS)

gpu-backlog:  # every step of tools/gpu-backlog.steps in order, each resuming where it stopped; results/raw/ tarred into results/gpu-window.tgz (bring it back, then `make report`s)
	PY=$(PY) LLAMA3B_RUN=$(LLAMA3B_RUN) OUT=results tools/gpu-window.sh 0

gpu-window:  # one window of a lent GPU (10 minutes a command, nothing kept between starts): the same steps until BUDGET_S, tarred into $$OUT
	PY=$(PY) LLAMA3B_RUN=$(LLAMA3B_RUN) tools/gpu-window.sh $(BUDGET_S)
