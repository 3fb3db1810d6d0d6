defmodule Bourse.TempPath do
  @moduledoc """
  Names in the temporary directory that no other test uses, nor a test of another run on
  this host (a unique integer alone repeats from one VM to the next, and a killed run
  leaves its sockets behind).
  """

  @doc "A new path in the temporary directory: `prefix`, this OS process, a number, `ext`."
  @spec new(String.t(), String.t()) :: Path.t()
  def new(prefix, ext \\ "") do
    name = "#{prefix}-#{System.pid()}-#{System.unique_integer([:positive])}#{ext}"
    Path.join(System.tmp_dir!(), name)
  end
end
