# The two commands: `make run` serves the example project (with its Celery worker), `make test` runs the suite.
# Both create .venv and install the pinned requirements on first use. The test and bench
# requirements include the base ones, so installing either counts as installing base too:
# `make run` after `make test` starts at once, without asking the package index again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test install install-test browser migrate clean bench bench-smoke

$(VENV)/.installed-%: requirements/%.txt requirements/base.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/$*.txt
	touch $@ $(if $(filter-out base,$*),$(VENV)/.installed-base)

install: $(VENV)/.installed-base
install-test: $(VENV)/.installed-test

migrate: install
	$(PY) manage.py migrate --noinput

# The server and a Celery worker with beat (the scheduled sweeps and compaction), as one job
# (project/serve.py): if either stops, so does the other; Ctrl-C or a SIGTERM stops both.
run: migrate
	$(PY) -m project.serve --stop-with-parent $(HOST):$(PORT)

test: install-test browser
	$(PY) -m pytest $(PYTEST_ARGS)

# Headless Chromium for the admin's browser tests (tests/test_admin_browser.py): Debian's
# packages, installed once where apt-get can (as root); elsewhere those tests skip, saying why.
browser:
	@test -x /usr/bin/chromedriver || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
		&& { apt-get install -y -qq chromium chromium-driver >/dev/null \
			|| { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; } \
		|| echo "no headless Chromium installed: the admin's browser tests will skip"; }

# Benchmarks against the peers on an embedded PostgreSQL 18 with pgvector (see BENCHMARKS.md):
# the full run (10 to 19 minutes on 2 cores) rewrites BENCHMARKS.md and bench/plots/;
# the smoke run (seconds; what CI runs through tests/test_bench_smoke.py) writes under var/.
$(VENV)/.installed-bench: requirements/test.txt

bench: $(VENV)/.installed-bench
	$(PY) -m bench.run $(BENCH_ARGS)

bench-smoke: install-test
	$(PY) -m bench.run --smoke --out var/bench-smoke

clean:
	rm -rf $(VENV) var .pytest_cache
