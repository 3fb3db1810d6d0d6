defmodule Mix.Tasks.Bourse.TopTest do
  # Not async: the task prints through `Mix.shell()`, which is global.
  use ExUnit.Case, async: false

  alias Bourse.{Fingerprint, RateLimiter}
  alias Mix.Tasks.Bourse.Top

  setup do
    Mix.shell(Mix.Shell.Process)
    on_exit(fn -> Mix.shell(Mix.Shell.IO) end)
    name = :"bourse_top_#{System.unique_integer([:positive])}"
    start_supervised!({RateLimiter, name: name})
    %{name: name}
  end

  test "table/1 aligns a header and one line per row" do
    rows = [
      %{
        exchange: "binance",
        credential: "key:1a2b3c4d",
        axis: "ip",
        limit: %{capacity: 1200.0, refill_per_sec: 20.0},
        tokens: -3.5,
        borrowed: 1203.5,
        bookings: 2,
        next_ready_ms: 175,
        pause_ms: nil
      },
      %{
        exchange: "okx",
        credential: :public,
        axis: "request",
        limit: nil,
        tokens: 0.0,
        borrowed: 3.0,
        bookings: 0,
        next_ready_ms: nil,
        pause_ms: 4000
      }
    ]

    assert Top.table(rows) ==
             """
             EXCHANGE  CREDENTIAL    AXIS     CAPACITY  REFILL/S  TOKENS  BORROWED  BOOKINGS  NEXT READY MS  PAUSE MS
             binance   key:1a2b3c4d  ip           1200        20   -3.50   1203.50         2            175         -
             okx       :public       request         -         -       0         3         0              -      4000\
             """
  end

  test "prints the busiest buckets of a limiter in this VM", %{name: name} do
    limit = %{capacity: 10, refill_per_sec: 0.01}
    assert :ok = RateLimiter.check_rate({"binance", "top-api-key", "ip"}, limit, 4, name)
    assert :ok = RateLimiter.check_rate({"okx", :public}, limit, 9, name)
    Top.run(["--name", ":#{name}", "--count", "5"])

    assert_received {:mix_shell, :info, [table]}
    assert [header, okx, binance] = String.split(table, "\n")
    assert header =~ ~r/^EXCHANGE\s+CREDENTIAL\s+AXIS\s+CAPACITY\s+REFILL\/S\s+TOKENS/
    assert okx =~ ~r/^okx\s+:public\s+request\s+10\s+0\.01\s+1\.0\d\s+(8\.9\d|9\.00)\s+0\s+-\s+-$/
    assert binance =~ "binance   #{Fingerprint.of("top-api-key")}  ip"
    refute table =~ "top-api-key"
  end

  test "module names are accepted as --name" do
    start_supervised!({RateLimiter, name: Bourse.TopTest.Limiter}, id: :module_name)
    Top.run(["--name", "Bourse.TopTest.Limiter"])
    assert_received {:mix_shell, :info, ["no busy buckets in Bourse.TopTest.Limiter"]}
  end

  # This VM, made a distributed node, stands for the remote one: the task reaches it
  # through :rpc exactly as it would another node.
  @tag :distributed
  test "--node queries a limiter on a node through :rpc", %{name: name} do
    :ok = Bourse.PeerNode.distribute(:bourse_top_test)
    on_exit(fn -> :net_kernel.stop() end)

    assert :ok =
             RateLimiter.check_rate(
               {"kraken", :public},
               %{capacity: 5, refill_per_sec: 0.01},
               5,
               name
             )

    cookie = Atom.to_string(Node.get_cookie())
    Top.run(["--node", "bourse_top_test@127.0.0.1", "--cookie", cookie, "--name", ":#{name}"])
    assert_received {:mix_shell, :info, [table]}
    assert table =~ ~r/\nkraken\s+:public\s+request\s+5\s+0\.01/

    # The cookie read from a file, as a release keeps it: off the command line.
    file = Bourse.TempPath.new("bourse-top-cookie")
    File.write!(file, cookie <> "\n")
    on_exit(fn -> File.rm(file) end)
    Top.run(["--node", "bourse_top_test@127.0.0.1", "--cookie-file", file, "--name", ":#{name}"])
    assert_received {:mix_shell, :info, [table]}
    assert table =~ ~r/\nkraken\s+:public\s+request\s+5\s+0\.01/

    assert_raise Mix.Error, ~r/cannot read --cookie-file .*: no such file or directory/, fn ->
      Top.run(["--node", "bourse_top_test@127.0.0.1", "--cookie-file", file <> ".none"])
    end

    assert_raise Mix.Error,
                 ~r/no limiter named :elsewhere runs on bourse_top_test@127.0.0.1/,
                 fn ->
                   Top.run(["--node", "bourse_top_test@127.0.0.1", "--name", ":elsewhere"])
                 end

    assert_raise Mix.Error, ~r/cannot connect to nobody@127.0.0.1/, fn ->
      Top.run(["--node", "nobody@127.0.0.1", "--name", ":#{name}"])
    end
  end

  test "errors are Mix errors", %{name: name} do
    assert_raise Mix.Error, ~r/no limiter named :nothing_here runs in this VM/, fn ->
      Top.run(["--name", ":nothing_here"])
    end

    assert_raise Mix.Error, ~r/count must be an integer/, fn ->
      Top.run(["--name", ":#{name}", "--count", "0"])
    end

    assert_raise Mix.Error, ~r/usage: mix bourse.top/, fn -> Top.run(["--frobnicate"]) end

    for node <- ["newapp", "newapp@", "@host", "a@b@c"] do
      assert_raise Mix.Error, ~r/--node must be name@host/, fn -> Top.run(["--node", node]) end
    end

    assert_raise Mix.Error, ~r/usage: mix bourse.top/, fn -> Top.run(["extra"]) end
  end

  test "--help prints how to use it" do
    Top.run(["--help"])
    assert_received {:mix_shell, :info, [help]}
    assert help =~ "mix bourse.top --node app@host --cookie-file PATH"
    assert help =~ "`--count`"
  end
end
