defmodule Bourse.ContractTests.OneField do
  @moduledoc "A struct of one field, offered as a limit in the contract tests."
  defstruct [:capacity]
end
