# k3train: two commands for a newcomer on a fresh machine.
#   make train   -- set up .venv, build the shipped corpus, train the tiny K3 config on CPU with 2 processes
#   make test    -- set up .venv, build the shipped corpus, run the whole test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
CONFIG ?= configs/tiny.yaml
LAYOUT ?= --parallel.pp=2 --parallel.vpp=2
ARGS   ?=
DATA   := data_cache/corpus_text_document

.PHONY: train test venv data clean count bench

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

data: $(DATA).bin
$(DATA).bin: $(VENV)/.installed tools/prepare_data.py k3train/data/assets/kjv.txt.gz k3train/data/assets/tokenizer.json
	$(PY) tools/prepare_data.py --shipped-corpus --output-prefix $(DATA)

train: venv data
	$(PY) -m k3train.train --check --world-size $(NPROC) --config $(CONFIG) $(LAYOUT) $(ARGS)
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) \
		-m k3train.train --config $(CONFIG) $(LAYOUT) $(ARGS)

test: venv data
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

count: venv
	$(PY) tools/count_params.py --config configs/k3.yaml

clean:
	rm -rf runs data_cache
