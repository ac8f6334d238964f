# The two commands: `make run` serves the example project, `make test` runs the suite.
# Both create .venv and install the pinned requirements on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test install install-test migrate clean

$(VENV)/.installed-%: requirements/%.txt requirements/base.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/$*.txt
	touch $@

install: $(VENV)/.installed-base
install-test: $(VENV)/.installed-test

migrate: install
	$(PY) manage.py migrate --noinput

run: migrate
	$(PY) manage.py runserver $(HOST):$(PORT)

test: install-test
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache
