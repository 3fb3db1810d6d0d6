defmodule Bourse.RateLimiter.ServerTest do
  # What only the limiter process shows: a backend that cannot start.
  use ExUnit.Case, async: true

  alias Bourse.RateLimiter
  alias Bourse.RateLimiter.{Options, Server}

  # Backends that fail to attach, each in its own way.
  defmodule Refusing do
    def attach(_previous, _opts), do: {:error, {:eaddrinuse, "SECRET-IN-A-REASON"}}
  end

  defmodule Raising do
    def attach(_previous, _opts), do: raise(ArgumentError, "no table today")
  end

  defmodule Erring do
    def attach(_previous, _opts), do: {:error, Bourse.Error.unavailable("store down")}
  end

  test "every failure to start is a %Bourse.Error{}" do
    for {backend, message} <- [
          {Refusing,
           "cannot start the limiter's #{inspect(Refusing)} backend: a tuple of 2 elements"},
          {Raising, "cannot start the limiter's #{inspect(Raising)} backend: no table today"},
          {Erring, "store down"}
        ] do
      name = :"server_test_#{System.unique_integer([:positive])}"
      {:ok, config} = Options.start(name: name)

      assert {:error, %Bourse.Error{type: :unavailable, message: ^message}} =
               Server.start_link(%{config | backend: backend})

      assert Process.whereis(name) == nil
      assert :persistent_term.get({Bourse.RateLimiter, name}, nil) == nil
    end
  end

  test "a failure to start in the limiter's process answers its error; the caller, not trapping exits, lives on" do
    test = self()
    name = :"server_test_#{System.unique_integer([:positive])}"
    backend = {:daemon, "127.0.0.1:7879", secret_file: "/nonexistent/bourse-secret"}

    {caller, monitor} =
      spawn_monitor(fn ->
        send(test, {:answer, RateLimiter.start_link(name: name, backend: backend)})
        # Long enough for an exit signal sent with the answer to arrive.
        Process.sleep(200)
        send(test, :alive)
      end)

    assert_receive {:answer, {:error, %Bourse.Error{type: :invalid_parameters, message: message}}}
    assert message =~ "secret_file"
    assert_receive :alive, 5_000
    assert_receive {:DOWN, ^monitor, :process, ^caller, :normal}
    assert Process.whereis(name) == nil
  end
end
