[
  inputs: ["{mix,.formatter}.exs", "{config,lib,test,bench,demo}/**/*.{ex,exs}"]
]
