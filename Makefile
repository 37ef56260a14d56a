# Developer entry points. `make demo` and `make test` are the README's quick start: each
# installs what is missing (torch, test tools, the compiled extension) and then runs.
PYTHON ?= python3
# The CPU wheel of this version lies on the project's CI machines; any torch >= 2.4 works.
TORCH_SPEC ?= torch==2.13.0
# The optional integrations' tested versions: `make test` installs them where missing, so that every CPU test runs.
EXTRAS_SPEC ?= transformers==5.24.0 peft==0.21.2 trl==1.16.0
STAMP := build/.nitrobrew-installed
BUILD_INPUTS := $(shell find csrc -type f) setup.py pyproject.toml nitrobrew/_build.py

.PHONY: install demo test cuda-check bench wheel

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_SPEC)"
	@$(PYTHON) -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); \
	  sys.exit(0 if v >= (2, 4) else 'nitrobrew needs torch >= 2.4, found ' + torch.__version__)"
	$(PYTHON) -m pip install --quiet ninja "pytest>=7" numpy expecttest
	$(PYTHON) -m pip install --no-build-isolation --no-deps -e .
	@mkdir -p build && touch $@

demo: install
	$(PYTHON) -m nitrobrew

test: install
	@$(PYTHON) -c "import transformers, peft, trl" 2>/dev/null || $(PYTHON) -m pip install --quiet $(EXTRAS_SPEC)
	$(PYTHON) -m pytest tests -q

# Compile (not link, not run) every CUDA source for sm_80 and sm_90a: the check CI can do
# without a GPU. (sm_100, which the default build adds with CUDA >= 12.8, compiles the sm_80 kernels with
# one more gate: NITROBREW_CUDA_ARCHS=10.0 make cuda-check; CI leaves it out for time, docs/development.md.)
cuda-check: install
	NITROBREW_CUDA_ARCHS="$${NITROBREW_CUDA_ARCHS:-8.0;9.0a}" bash tools/ci/compile_cuda.sh

bench: install
	$(PYTHON) benchmarks/fused_linear.py

# A wheel for the installed torch (its version tag and pin say which: docs/development.md), in dist/. -v shows
# ninja's [n/N] progress.
wheel:
	@$(PYTHON) -c "import torch" 2>/dev/null || (echo "install the torch the wheel is for first"; exit 1)
	$(PYTHON) -m pip wheel -v --no-build-isolation --no-deps -w dist .
