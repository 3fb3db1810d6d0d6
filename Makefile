# make deps | build | lint | dialyzer | test | demo | bench
SHELL := /bin/bash
export LANG := C.UTF-8
export LC_ALL := C.UTF-8
export MIX_ENV ?= dev

APT_PACKAGES := elixir erlang-dev erlang-dialyzer erlang-proper redis-server lua5.1 python3 procps
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: deps build lint dialyzer test demo bench

# Dialyzer's PLT of OTP and Elixir (about a minute to build), kept per OTP/Elixir version.
PLT_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/bourse
PLT_APPS := erts kernel stdlib crypto inets compiler

deps:
	@if ! command -v elixir >/dev/null || ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $(APT_PACKAGES); \
	fi
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs)"; exit 1; }

build: deps
	mix compile

lint: deps
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	mix format --check-formatted
	MIX_ENV=test mix compile --warnings-as-errors
	$(MAKE) --no-print-directory dialyzer

# Dialyzer over lib/ (the dev build: no test support modules).
dialyzer: deps
	MIX_ENV=dev mix compile
	@set -e; \
	lib=$$(elixir -e 'IO.write(Path.dirname(:code.lib_dir(:elixir)))'); \
	plt=$(PLT_DIR)/otp$$(elixir -e 'IO.write(System.otp_release() <> "-elixir" <> System.version())').plt; \
	if [ ! -f "$$plt" ]; then \
	  echo "Building $$plt"; mkdir -p $(PLT_DIR); \
	  dialyzer --build_plt --output_plt "$$plt.$$$$" -pa $$lib/elixir/ebin --apps $(PLT_APPS) \
	    $$lib/elixir/ebin $$lib/logger/ebin $$lib/mix/ebin; \
	  mv "$$plt.$$$$" "$$plt"; \
	fi; \
	dialyzer --plt "$$plt" --no_check_plt -pa $$lib/elixir/ebin _build/dev/lib/bourse/ebin

# The Python client's tests run the daemon `cargo test` just built, not whatever an earlier
# build left in target/debug. The VM's clock stays on the OS's monotonic clock, as the
# stores' do, when the wall clock is set (README, "Bookings").
test: lint
	cargo test --workspace --release
	ELIXIR_ERL_OPTIONS="+C multi_time_warp" MIX_ENV=test mix test
	BOURSE_DAEMON=target/release/bourse_daemon python3 -m unittest discover -s test/cross_process

demo: build
	mix run demo/demo.exs

bench: build
	mix run bench/run.exs
