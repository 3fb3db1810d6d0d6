defmodule Bourse.DependentAppTest do
  # A new Mix application, made in a temporary folder with a path dependency on this
  # checkout and nothing else in its mix.exs, built the ways a user builds it: `mix compile`
  # from source, with prebuilt artifacts, `MIX_ENV=prod mix release`, and the README's
  # examples run in it.
  use ExUnit.Case, async: false

  import Bourse.Loopback, only: [free_port: 0]

  alias Bourse.{DaemonServer, RedisServer}
  alias Mix.BourseNative.Prebuilt

  @moduletag timeout: 900_000

  @checkout Path.expand("../..", __DIR__)
  @readme Path.join(@checkout, "README.md")

  # The limiters the release starts in its supervision tree and checks once booted, one
  # line per backend: the limiter's name and its `start_link/1` options, as Elixir code
  # evaluated in the release when it boots (the test's daemon and Redis server are passed
  # in the release's environment).
  @release_backends [
    {"DepApp.Limiter.NIF", "[backend: :nif]"},
    {"DepApp.Limiter.Port", "[backend: :port]"},
    {"DepApp.Limiter.Unix",
     ~s/[backend: {:daemon, {:unix, System.fetch_env!("DEP_APP_DAEMON_UNIX")}}]/},
    {"DepApp.Limiter.TCP", ~s/[backend: {:daemon, System.fetch_env!("DEP_APP_DAEMON_TCP")}]/},
    {"DepApp.Limiter.Redis", ~s/[backend: {:redis, System.fetch_env!("DEP_APP_REDIS_URL")}]/}
  ]

  setup_all do
    tmp = Bourse.TempPath.new("bourse_dependent_app")

    on_exit(fn -> File.rm_rf!(tmp) end)
    app = Path.join(tmp, "dep_app")
    write_app(app)

    # This checkout's own build, packaged: the prod build and the release skip cargo.
    prebuilt = Path.join(tmp, "prebuilt")

    ExUnit.CaptureIO.capture_io(fn ->
      Mix.Tasks.Bourse.Native.Package.run(["--output", prebuilt])
    end)

    # cargo as found in PATH, logging each run; and a cargo that only logs and fails.
    real_cargo = System.find_executable("cargo")
    log = Path.join(tmp, "cargo.log")
    cargo_bin = fake_cargo(Path.join(tmp, "bin"), log, "exec #{real_cargo} \"$@\"")
    no_cargo_bin = fake_cargo(Path.join(tmp, "no-cargo-bin"), log, "exit 1")

    %{
      tmp: tmp,
      app: app,
      prebuilt: prebuilt,
      log: log,
      cargo_path: cargo_bin <> ":" <> System.get_env("PATH"),
      no_cargo_path: no_cargo_bin <> ":" <> System.get_env("PATH")
    }
  end

  test "from source, a second mix compile runs no cargo and prints nothing", ctx do
    env = [{"PATH", ctx.cargo_path}, {"BOURSE_NATIVE_PREBUILT_DIR", nil}]
    File.rm_rf!(Path.join(ctx.app, "_build/dev"))
    runs = cargo_runs(ctx)

    {first_s, {_output, 0}} = timed(fn -> mix(ctx, ["compile"], "dev", env) end)
    assert cargo_runs(ctx) == runs + 1

    {second_s, {output, 0}} = timed(fn -> mix(ctx, ["compile"], "dev", env) end)
    assert output == ""
    assert {"ran\n", 0} = mix(ctx, ["run", "-e", "IO.puts(:ran)"], "dev", env)
    assert cargo_runs(ctx) == runs + 1

    IO.puts(
      "\ndependent app from source: first mix compile #{first_s} s (cargo's target/ warm), " <>
        "second #{second_s} s"
    )
  end

  test "prebuilt artifacts are used when configured, refused when they do not match", ctx do
    env = [{"PATH", ctx.no_cargo_path}]
    runs = cargo_runs(ctx)
    nif = List.to_string(:erlang.system_info(:nif_version))
    [major, _minor] = String.split(nif, ".")

    for {field, value, message} <- [
          {"nif_version", "#{String.to_integer(major) + 1}.0",
           ~s(built for NIF version "#{String.to_integer(major) + 1}.0")},
          {"target", "riscv64gc-unknown-linux-gnu",
           ~s(built for target "riscv64gc-unknown-linux-gnu", this machine is "#{Prebuilt.beam_target()}")}
        ] do
      mismatched = Path.join(ctx.tmp, "prebuilt-#{field}")
      File.cp_r!(ctx.prebuilt, mismatched)
      manifest = Path.join(mismatched, "bourse_native.manifest")

      File.write!(
        manifest,
        Regex.replace(~r/\{#{field},"[^"]*"\}/, File.read!(manifest), ~s({#{field},"#{value}"}))
      )

      {output, status} =
        mix(ctx, ["compile"], "prod", [{"BOURSE_NATIVE_PREBUILT_DIR", mismatched} | env])

      assert status != 0
      assert output =~ "cannot use the prebuilt :bourse native artifacts in #{mismatched}"
      assert output =~ message
    end

    {prebuilt_s, {_output, 0}} = timed(fn -> compile_prebuilt(ctx) end)
    {again_s, {"", 0}} = timed(fn -> compile_prebuilt(ctx) end)
    assert cargo_runs(ctx) == runs

    IO.puts(
      "\ndependent app with prebuilt artifacts: mix compile #{prebuilt_s} s, again #{again_s} s"
    )
  end

  test "a release (MIX_ENV=prod mix release) boots and checks through every backend", ctx do
    socket = Path.join(ctx.tmp, "daemon.sock")
    daemon = DaemonServer.start(["--socket", socket, "--listen", "127.0.0.1:0"])
    redis = RedisServer.start()

    on_exit(fn ->
      DaemonServer.stop(daemon)
      RedisServer.stop(redis)
    end)

    assert {_, 0} = compile_prebuilt(ctx)

    {release_s, {output, status}} =
      timed(fn -> mix(ctx, ["release", "--overwrite"], "prod", prebuilt_env(ctx)) end)

    assert status == 0, output
    release = Path.join(ctx.app, "_build/prod/rel/dep_app")
    [priv] = Path.wildcard(Path.join(release, "lib/bourse-*/priv/native"))

    for file <- ~w(libbourse_nif.so bourse_daemon),
        do: assert(File.lstat!(Path.join(priv, file)).type == :regular)

    # Started as a user starts it: no ERL_LIBS (the VM's own libraries, such as a system
    # erlang-jiffy, are not the release's), the daemon's secret in the environment.
    {output, status} =
      System.cmd("timeout", ["120", Path.join(release, "bin/dep_app"), "start"],
        env: [
          {"DEP_APP_CHECK", "1"},
          {"RELEASE_DISTRIBUTION", "none"},
          {"ERL_LIBS", nil},
          {"DEP_APP_DAEMON_UNIX", daemon.unix},
          {"DEP_APP_DAEMON_TCP", daemon.tcp},
          {"DEP_APP_REDIS_URL", redis.url},
          {"BOURSE_DAEMON_SECRET", DaemonServer.secret()}
        ],
        stderr_to_stdout: true
      )

    assert status == 0, output

    for {name, _opts} <- @release_backends do
      assert output =~ ~r/checked #{name}: \[:ok, :ok, \{:delay, \d+\}\]/, output
    end

    # Nothing beyond the release itself: no JSON library on its code path.
    assert output =~ "jiffy: :non_existing", output

    assert output =~ "backoff: [1000, 2000]", output
    assert output =~ "bourse priv: #{Path.dirname(priv)}"
    IO.puts("\ndependent app: mix release #{release_s} s")
  end

  test "every Elixir example of the README runs as written in the application", ctx do
    blocks = Regex.scan(~r/^```elixir\n(.*?)^```/ms, File.read!(@readme), capture: :all_but_first)
    assert length(blocks) >= 5
    dir = Path.join(ctx.app, "readme")
    File.mkdir_p!(dir)

    # Each in a VM of its own, as written for.
    for {[code], index} <- Enum.with_index(blocks, 1) do
      file = Path.join(dir, "example_#{index}.exs")
      File.write!(file, code)
      env = [{"PATH", ctx.cargo_path}, {"BOURSE_NATIVE_PREBUILT_DIR", nil}]
      {output, status} = mix(ctx, ["run", file], "dev", env)
      assert status == 0, "README example #{index} failed:\n#{code}\n#{output}"
    end
  end

  test "the README's shared-daemon commands run as written from the application", ctx do
    [_, section] = String.split(File.read!(@readme), "\n## Backends", parts: 2)
    [section | _] = String.split(section, "\n## ", parts: 2)

    [daemon, elixir_client, python_client] =
      Regex.scan(~r/^```sh\n(.*?)^```/ms, section, capture: :all_but_first) |> List.flatten()

    # The README's address, moved to a free port.
    port = free_port()

    moved =
      &(&1
        |> String.replace("127.0.0.1:7878", "127.0.0.1:#{port}")
        |> String.replace("7878)", "#{port})"))

    env = [{"MIX_ENV", "dev"}, {"PATH", ctx.cargo_path}, {"BOURSE_NATIVE_PREBUILT_DIR", nil}]

    server =
      Port.open({:spawn_executable, System.find_executable("sh")}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        args: ["-c", moved.(daemon)],
        cd: ctx.app,
        env:
          for(
            {k, v} <- env,
            do: {String.to_charlist(k), if(v, do: String.to_charlist(v), else: false)}
          )
      ])

    # A port's program leads a process group of its own: sh, then mix's VM.
    {:os_pid, os_pid} = Port.info(server, :os_pid)
    on_exit(fn -> System.cmd("sh", ["-c", "kill -- -#{os_pid}"], stderr_to_stdout: true) end)
    assert_receive {^server, {:data, "listening tcp 127.0.0.1:" <> _}}, 120_000
    # Started with --assume-busy-at-start, the daemon's buckets hold what they earned since
    # it started, 20 tokens a second here: the clients' 15 are there after a second (a
    # fast run once had Python's check come 0.7 s after the start, and refused).
    Process.sleep(1_000)

    # The clients run where the daemon's secret was exported, as in a user's shell.
    address = "127.0.0.1:#{port}"

    [secret] =
      for pid <- File.ls!("/proc"),
          {:ok, cmdline} <- [File.read("/proc/#{pid}/cmdline")],
          [program, "--listen", ^address | _] <- [String.split(cmdline, <<0>>)],
          Path.basename(program) == "bourse_daemon",
          variable <- String.split(File.read!("/proc/#{pid}/environ"), <<0>>),
          "BOURSE_DAEMON_SECRET=" <> secret <- [variable],
          do: secret

    env = [{"BOURSE_DAEMON_SECRET", secret} | env]

    assert {output, 0} =
             System.cmd("sh", ["-c", moved.(elixir_client)],
               cd: ctx.app,
               env: env,
               stderr_to_stdout: true
             )

    assert output == ":ok\n:ok\n"

    assert {output, 0} =
             System.cmd("sh", ["-c", moved.(python_client)],
               cd: @checkout,
               env: env,
               stderr_to_stdout: true
             )

    assert output =~ ~r/^True \d+\n$/
  end

  defp compile_prebuilt(ctx), do: mix(ctx, ["compile"], "prod", prebuilt_env(ctx))

  defp prebuilt_env(ctx),
    do: [{"PATH", ctx.no_cargo_path}, {"BOURSE_NATIVE_PREBUILT_DIR", ctx.prebuilt}]

  defp mix(ctx, args, mix_env, env) do
    clean =
      for name <- ~w(MIX_EXS MIX_BUILD_PATH MIX_BUILD_ROOT MIX_DEPS_PATH MIX_TARGET),
          do: {name, nil}

    System.cmd("mix", args,
      cd: ctx.app,
      env: clean ++ [{"MIX_ENV", mix_env} | env],
      stderr_to_stdout: true
    )
  end

  defp timed(fun) do
    {micros, result} = :timer.tc(fun)
    {Float.round(micros / 1_000_000, 1), result}
  end

  defp cargo_runs(ctx) do
    case File.read(ctx.log) do
      {:ok, log} -> length(String.split(log, "\n", trim: true))
      {:error, :enoent} -> 0
    end
  end

  defp fake_cargo(bin, log, then) do
    File.mkdir_p!(bin)
    File.write!(Path.join(bin, "cargo"), "#!/bin/sh\necho \"$@\" >> #{log}\n#{then}\n")
    File.chmod!(Path.join(bin, "cargo"), 0o755)
    bin
  end

  defp write_app(app) do
    File.mkdir_p!(Path.join(app, "lib/dep_app"))

    File.write!(Path.join(app, "mix.exs"), """
    defmodule DepApp.MixProject do
      use Mix.Project

      def project do
        [
          app: :dep_app,
          version: "0.1.0",
          elixir: "~> 1.14",
          start_permanent: Mix.env() == :prod,
          deps: [{:bourse, path: #{inspect(@checkout)}}]
        ]
      end

      def application, do: [mod: {DepApp.Application, []}, extra_applications: [:logger]]
    end
    """)

    File.write!(Path.join(app, "lib/dep_app/application.ex"), """
    defmodule DepApp.Application do
      use Application

      # With DEP_APP_CHECK=1: a limiter per backend in the tree, checked once it is up.
      @impl true
      def start(_type, _args) do
        children =
          if System.get_env("DEP_APP_CHECK") == "1" do
            limiters =
              for {name, opts} <- DepApp.Backends.all(),
                  do: Supervisor.child_spec({Bourse.RateLimiter, [name: name] ++ opts}, id: name)

            limiters ++ [Supervisor.child_spec({Task, &DepApp.Check.run/0}, restart: :temporary)]
          else
            []
          end

        Supervisor.start_link(children, strategy: :one_for_one, name: DepApp.Supervisor)
      end
    end
    """)

    File.write!(Path.join(app, "lib/dep_app/backends.ex"), """
    defmodule DepApp.Backends do
      def all do
        [#{Enum.map_join(@release_backends, ", ", fn {name, opts} -> "{#{name}, #{opts}}" end)}]
      end
    end
    """)

    File.write!(Path.join(app, "lib/dep_app/check.ex"), """
    defmodule DepApp.Check do
      def run do
        for {name, _opts} <- DepApp.Backends.all() do
          limit = %{capacity: 2, refill_per_sec: 0.001}
          # The daemon backends share one table: a key of each limiter's own.
          key = {"binance", "release-api-key-\#{inspect(name)}", "request"}
          answers = for _ <- 1..3, do: Bourse.RateLimiter.check_rate(key, limit, 1, name)
          IO.puts("checked \#{inspect(name)}: \#{inspect(answers)}")
        end

        # Two 429s without Retry-After, the second after the first's pause, back off 1 s
        # then 2 s, counted in the limiter's table.
        backoff =
          for pause <- [0, 1_000] do
            Process.sleep(pause)

            {:error, error} =
              Bourse.RateLimiter.observe_response("okx", "release-api-key", 429, [], DepApp.Limiter.NIF)

            error.retry_after
          end

        IO.puts("backoff: \#{inspect(backoff)}")
        IO.puts("bourse priv: \#{:code.priv_dir(:bourse)}")
        IO.puts("jiffy: \#{inspect(:code.which(:jiffy))}")
        System.stop(0)
      end
    end
    """)
  end
end
