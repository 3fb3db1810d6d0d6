# The native compiler ships in lib/ but must run before lib/ is compiled, also when
# :bourse is a dependency: load it from here. `ignore_module_conflict` below lets the
# Elixir compiler build the same modules into ebin without a redefinition warning.
for file <- ~w(bourse_native/inputs.ex bourse_native/prebuilt.ex tasks/compile.bourse_native.ex),
    do: Code.require_file("lib/mix/#{file}", __DIR__)

defmodule Bourse.MixProject do
  use Mix.Project

  def project do
    [
      app: :bourse,
      version: "0.1.0",
      elixir: "~> 1.14",
      compilers: [:bourse_native] ++ Mix.compilers(),
      elixirc_paths: elixirc_paths(Mix.env()),
      elixirc_options: [ignore_module_conflict: true],
      start_permanent: Mix.env() == :prod,
      deps: []
    ]
  end

  def application do
    [extra_applications: [:logger, :inets, :crypto]]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]
end
