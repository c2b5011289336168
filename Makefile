# Two entry points: `make train` (tiny CPU training job) and `make test` (the test suite).
# Both create .venv with Python 3.12 when it is missing and install the package with its
# test extras; the install is redone when pyproject.toml changes. `make test` also puts the GPU machine's
# Triton release beside it (below).

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.12: `python3.12` on PATH, else a pyenv-installed 3.12.x.
find_python312 = $(shell \
	if python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
		command -v python3.12; \
	elif command -v pyenv >/dev/null 2>&1; then \
		for v in $$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | sort -V -r); do \
			p="$$(pyenv root)/versions/$$v/bin/python3.12"; \
			if [ -x "$$p" ]; then echo "$$p"; break; fi; \
		done; \
	fi)

.PHONY: train test install clean

$(PY):
	@py="$(call find_python312)"; \
	if [ -z "$$py" ]; then echo "error: Python 3.12 not found (install it, or pyenv install 3.12)" >&2; exit 1; fi; \
	echo "creating $(VENV) with $$py"; \
	"$$py" -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

# The GPU machine's Triton (its torch 2.11 ships 3.6.0; PyPI's torch brings a newer one here), for `make test` only:
# the compile tests also run against it (tests/kernels/test_device_triton.py), since register use and spills differ
# by release.
DEVICE_TRITON := 3.6.0
DEVICE_TRITON_DIR := $(VENV)/device-triton
# named by the release: changing DEVICE_TRITON reinstalls
DEVICE_TRITON_STAMP := $(DEVICE_TRITON_DIR)/.installed-$(DEVICE_TRITON)

$(DEVICE_TRITON_STAMP): | $(STAMP)
	rm -rf $(DEVICE_TRITON_DIR)
	$(PY) -m pip install --quiet --no-deps --target $(DEVICE_TRITON_DIR) 'triton==$(DEVICE_TRITON)'
	@touch $@

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 launch/train.py --config configs/tiny.yaml $(ARGS)

test: $(STAMP) $(DEVICE_TRITON_STAMP)
	KIMI_DEVICE_TRITON=$(abspath $(DEVICE_TRITON_DIR)) $(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs
