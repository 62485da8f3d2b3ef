# Two commands on a fresh Debian/Ubuntu machine with Python 3.11 (README "Set up", docs/setup.md). Each installs what
# is missing first (tools/install_cpu.sh; a second run installs nothing), then:
#   make cpu     the main job on a CPU: SmolLM2-135M-Instruct learning word problems (examples/smollm2_cpu.sh;
#                ARGS="dapo.py --seed 2" picks another script and flags)
#   make test    the tests (PYTEST_ARGS="tests/test_ppo.py -k gae" runs some); CI runs them too (.ci/run)
#   make install the install alone
# The Python: PYTHON=... if given, else the active virtual environment's, else .venv/ (made with python3.11).
ifdef VIRTUAL_ENV
PYTHON ?= $(VIRTUAL_ENV)/bin/python
else
PYTHON ?= .venv/bin/python
endif
export PYTHON HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: install cpu test

install:
	bash tools/install_cpu.sh

# examples/smollm2_cpu.sh calls `python`: the one installed into comes first on PATH
cpu: install
	PATH="$$($(PYTHON) -c 'import os, sys; print(os.path.dirname(sys.executable))'):$$PATH" \
		bash examples/smollm2_cpu.sh $(ARGS)

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)
