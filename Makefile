# lockstep entry points. `make demo` and `make test` each install what they need.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
BUILD := build
CFLAGS_STRICT := -O2 -Wall -Wextra -Werror
MSRV := $(shell sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
RUN_SUITE := --test run_output --test run_extra --test run_process --test run_signals \
	--test run_faults --test run_cpython --test run_fast_shim

.PHONY: all deps build clib demo test bench cpython-suite sei-thirdparty lint clean

all: build

deps:
	@scripts/deps.sh test

build: deps clib
	$(CARGO) build --release --locked

# The C side: the lockstep_trace() library and the demo workload.
clib: $(BUILD)/liblockstep.a $(BUILD)/demo-ledger

$(BUILD)/liblockstep.a: clib/lockstep_trace.c clib/include/lockstep.h
	@mkdir -p $(BUILD)
	gcc $(CFLAGS_STRICT) -c clib/lockstep_trace.c -o $(BUILD)/lockstep_trace.o
	ar rcs $@ $(BUILD)/lockstep_trace.o

$(BUILD)/demo-ledger: examples/demo/ledger.c
	@mkdir -p $(BUILD)
	gcc $(CFLAGS_STRICT) -static -o $@ $<

demo: build
	@scripts/demo.sh

test: deps clib
	$(CARGO) fmt --all -- --check
	$(CARGO) deny check bans licenses sources
	# The minimum Rust the workspace declares (rust-version) must build it.
	$(CARGO) +$(MSRV) check --workspace --all-targets --locked --target-dir target/msrv
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings
	$(CARGO) test --workspace --locked -- --test-threads=2
	# The run suite once more on the ptrace backend (the default is fast; docs/run.md).
	LOCKSTEP_BACKEND=ptrace $(CARGO) test -p lockstep-cli --locked $(RUN_SUITE) -- --test-threads=2

# CPython's regression suite under lockstep run (a fast subset is in `make test`).
cpython-suite: build
	scripts/cpython_suite.sh

# memcached from Debian's source package, configured, built and tested with CC="lockstep cc".
sei-thirdparty: build
	scripts/sei_thirdparty.sh

bench: build
	@scripts/deps.sh bench
	python3 bench/run.py
	python3 bench/fast_bench.py
	python3 bench/memcached_bench.py
	python3 bench/server_costs.py
	python3 bench/signal_bench.py
	python3 bench/order_programs.py --runs 10
	python3 bench/kernels.py
	python3 bench/nginx_bench.py
	bench/placement.sh
	bench/inject_eval.sh 1000
	bench/inject_throughput.sh 300 reg
	python3 bench/sei_bench.py 5
	bench/sei_eval.sh 1000
	bench/sei_ledger_eval.sh 1300
	python3 bench/kv_bench.py 5 3
	python3 bench/fs_bench.py 5 3
	python3 bench/fs_vs_bindfs.py 5 3
	python3 bench/kv_audit_cost.py
	scripts/cpython_suite.sh

lint:
	$(CARGO) fmt --all
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean:
	rm -rf $(BUILD)
	$(CARGO) clean
