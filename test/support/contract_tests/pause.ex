defmodule Bourse.ContractTests.Pause do
  @moduledoc false
  # `pause/3`: held buckets for every caller, nothing paid.
  # Part of `Bourse.ContractTests`, which sets the imports and attributes used here.

  defmacro __using__(_opts) do
    quote location: :keep do
      describe "pause" do
        test "a key: probes answer the remaining pause; nothing is paid", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          key = {"ex", "k", "request"}
          assert :ok = pause(key, 5_000, name)

          first = assert_delay(check_rate(key, limit, 1, name), 2_000..5_000)
          assert_delay(check_rate({"ex", "k"}, limit, 1, name), 1..first)

          assert_delay(
            check_rates([{key, limit, 1}, {{"ex", "k", "ip"}, limit, 1}], name),
            1..first
          )

          assert get_cost(key, 1, name) == 0
          assert get_cost({"ex", "k", "ip"}, 1, name) == 0

          # Other axes, credentials and exchanges are not held.
          assert :ok = check_rate({"ex", "k", "ip"}, limit, 1, name)
          assert :ok = check_rate({"ex", "k2", "request"}, limit, 1, name)
          assert :ok = check_rate({"other", "k", "request"}, limit, 1, name)
        end

        test "inspect_key shows a pause over a key the limiter holds no bucket for",
             %{name: name} do
          assert :ok = pause({"ex", "k"}, 5_000, name)
          assert :ok = pause({"ex", "k3", "request"}, 5_000, name)

          for key <- [{"ex", "k", "never-checked"}, {"ex", "k3", "request"}] do
            assert %{limit: nil, bookings: 0, pause_ms: ms} =
                     Bourse.RateLimiter.inspect_key(key, name)

            assert ms in 1..5_000
          end

          assert Bourse.RateLimiter.inspect_key({"ex", "k2", "request"}, name) == nil
        end

        test "after a pause the bucket is as it was: nothing was paid", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 0.001}
          key = {"ex", "k"}
          assert :ok = pause("ex", 0, name)
          assert :ok = pause(key, 500, name)
          paused_at = now_ms()

          # Checks while the pause surely lasts (a loaded machine may be slow).
          for _ <- 1..20, now_ms() < paused_at + 450 do
            assert {:delay, _} = check_rate(key, limit, 1, name)
          end

          Process.sleep(max(0, paused_at + 550 - now_ms()))
          assert :ok = check_rate(key, limit, 5, name)
        end

        test "{exchange_id, credential_key}: every axis of that credential", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          assert :ok = pause({"ex", "k"}, 5_000, name)
          assert :ok = pause({"ex", :public}, 5_000, name)

          for key <- [{"ex", "k"}, {"ex", "k", "ip"}, {"ex", "k", "uid"}, {"ex", :public, "ip"}] do
            assert_delay(check_rate(key, limit, 1, name), 1..5_000)
          end

          for key <- [{"ex", "k2", "ip"}, {"ex", "public", "ip"}, {"other", "k", "ip"}] do
            assert :ok = check_rate(key, limit, 1, name)
          end
        end

        test "an exchange id: every key of the exchange", %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          assert :ok = pause("ex", 5_000, name)

          for key <- [{"ex", "k"}, {"ex", "k2", "ip"}, {"ex", :public, "uid"}] do
            assert_delay(check_rate(key, limit, 1, name), 1..5_000)
          end

          for key <- [{"ex2", "k"}, {"e", "k"}], do: assert(:ok = check_rate(key, limit, 1, name))
        end

        test "waiters book behind a pause; the later end of overlapping pauses holds",
             %{name: name} do
          limit = %{capacity: 5, refill_per_sec: 1}
          key = {"ex", "k"}
          paused_at = System.monotonic_time(:microsecond)
          assert :ok = pause(key, 300, name)

          # Not admitted before the pause ends.
          assert :ok = wait_for_capacity(key, limit, 1, name)
          waited = (System.monotonic_time(:microsecond) - paused_at) / 1000
          assert waited >= 299, "admitted #{waited} ms into a 300 ms pause"
          assert :ok = check_rate(key, limit, 1, name)

          assert :ok = pause({"ex", "o"}, 5_000, name)
          assert :ok = pause({"ex", "o"}, 50, name)
          assert_delay(check_rate({"ex", "o"}, limit, 1, name), 1_000..5_000)
        end

        # A token every 500 ms: the other credential's check may come up to 500 ms after
        # the claims (a loaded machine) and still find the IP bucket as they left it.
        test "bookings a credential's pause holds are paid on the IP bucket at its end",
             %{name: name} do
          limit = %{capacity: 2, refill_per_sec: 2}
          ip = {"ex", :public, "ip"}
          mine = [{{"ex", "k"}, limit, 1}, {ip, limit, 1}]
          for _ <- 1..2, do: assert(:ok = check_rates(mine, name))
          test = self()

          # Two waiters book the next two tokens of both buckets (at 500 and 1000 ms), then
          # each comes back when told until claimed.
          waiters =
            for _ <- 1..2 do
              Task.async(fn ->
                booked = check_rates(mine, name, max_wait_ms: 5_000)
                send(test, :booked)
                receive do: (:paused -> claim_when_told(booked, mine, name))
              end)
            end

          for _ <- waiters, do: assert_receive(:booked, 5_000)
          assert :ok = pause({"ex", "k"}, 1_500, name)
          for waiter <- waiters, do: send(waiter.pid, :paused)
          assert Task.await_many(waiters, 10_000) == [:ok, :ok]

          # Paid on the IP bucket as of their old ready times, the held waiters would leave
          # it a token of its refill during the pause: 3 out at once from 2 tokens.
          assert {:delay, _} = check_rates([{{"ex", "k2"}, limit, 1}, {ip, limit, 1}], name)
        end

        test "bad targets and durations are invalid", %{name: name} do
          for target <- [
                :ex,
                1,
                {"ex"},
                {"ex", 1},
                {"ex", "k", :ip},
                {"ex", "k", "ip", "x"},
                ["ex"]
              ] do
            assert_invalid(pause(target, 100, name))
          end

          for ms <- [-1, 1.5, :infinity, "100", nil] do
            assert_invalid(pause("ex", ms, name))
          end

          assert :ok = check_rate({"ex", "k"}, @still, 1, name)
        end
      end
    end
  end
end
