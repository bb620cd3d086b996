# One entry point for set-up, demo and tests. Every target creates the venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: mutation-recheck venv system-deps demo test test-fast lint typecheck unit proto proto-check bench clean mutation docs

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements-dev.txt agent/_digest.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	@$(PY) -c "import cohortgate.agent._digest" 2>/dev/null || echo "warning: the weight digest's C kernel" \
	  "(agent/_digest.c) was not built (no C compiler or Python headers?): CPU digests use" \
	  "torch ops, ~5x slower, and the suite's kernel test fails" >&2
	touch $(STAMP)

## demo: a coordinator plus a real 4-rank torchrun job that forms, then one that is refused
demo: venv
	$(PY) examples/demo.py

## system-deps: Debian's chromium (installed: it enables no service), prometheus with
## promtool, etcd-server and etcd-client (unpacked into $(VENV) only: the packages would enable
## and start prometheus.service and etcd.service, etcd on port 2379), which the operations
## and failover tests drive; the tests start their own etcd on free loopback ports
PROM := $(VENV)/prometheus/usr/bin
ETCD := $(VENV)/etcd/usr/bin
TEST_PATH := $(abspath $(PROM)):$(abspath $(ETCD))
system-deps: venv
	@if ! command -v chromium >/dev/null || ! [ -x $(PROM)/promtool ] || ! [ -x $(ETCD)/etcdctl ]; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "install chromium, and put prometheus and promtool in $(PROM):" \
	      "the operations tests need them" >&2; exit 1; fi; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q; \
	fi; \
	if ! command -v chromium >/dev/null; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    chromium; fi; \
	if ! [ -x $(PROM)/promtool ]; then \
	  rm -rf $(VENV)/debs && mkdir -p $(VENV)/debs && \
	  (cd $(VENV)/debs && apt-get download -q prometheus) && \
	  dpkg-deb -x $(VENV)/debs/prometheus_*.deb $(VENV)/prometheus; fi; \
	if ! [ -x $(ETCD)/etcd ] || ! [ -x $(ETCD)/etcdctl ]; then \
	  rm -rf $(VENV)/etcd-debs && mkdir -p $(VENV)/etcd-debs && \
	  (cd $(VENV)/etcd-debs && apt-get download -q etcd-server etcd-client) && \
	  dpkg-deb -x $(VENV)/etcd-debs/etcd-server_*.deb $(VENV)/etcd && \
	  dpkg-deb -x $(VENV)/etcd-debs/etcd-client_*.deb $(VENV)/etcd; fi

## test: everything CI runs: generated-code check, ruff, import contracts, mypy, pytest
## (every tier), with the 15 slowest tests printed
# Two workers (pytest-xdist): most tests wait (graces, deadlines, real processes), so two at
# a time take about two thirds of the time on 2 cores; every test holds under that load.
TEST_WORKERS ?= 2
test: venv system-deps proto-check lint typecheck
	PATH="$(TEST_PATH):$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15

## test-fast: the fast tier, for every change: no real torchrun job, browser or test that
## waits out a timeout (markers e2e and slow); under 2 minutes on 2 cores
test-fast: venv system-deps
	PATH="$(TEST_PATH):$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not e2e and not slow" --durations=10

## docs: the documentation site (MkDocs, Material) into site/; --strict: a broken link, a
## missing page or a flag the docs name that the code does not take fails it
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy

proto: venv
	$(PY) scripts/gen_proto.py

proto-check: venv
	$(PY) scripts/gen_proto.py --check

## mutation: mutants of the verdict, security and digest code (pyproject's [tool.mutmut])
## against the tests that start no torchrun job; hours on 2 cores; not part of test
mutation: venv
	$(PY) -m pip install -q mutmut==3.8.1
	rm -rf mutants
	# cohortgate/ links to agent/ and coordinator/: links, not copies, so that the mutated
	# files (pyproject names them by their cohortgate/ paths, as the tests import them) and
	# the copies of also_copy land in one tree under mutants/
	mkdir -p mutants/cohortgate mutants/agent mutants/coordinator
	cp cohortgate/__init__.py cohortgate/py.typed mutants/cohortgate/
	ln -s ../agent mutants/cohortgate/agent && ln -s ../coordinator mutants/cohortgate/coordinator
	PATH="$(TEST_PATH):$$PATH" COHORTGATE_EXAMPLES_SCALE=0.1 $(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results --all true | awk '{print $$NF}' | sort | uniq -c

## mutation-recheck: run each mutant `make mutation` reported as survived again by hand (mutmut
## 3.8.1 reports some killed ones as survived); writes mutation-recheck.json
mutation-recheck: venv
	$(PY) scripts/mutation_recheck.py

bench: venv
	$(PY) bench/bench_signature.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
