import Config

# Longest wait `Bourse.RateLimiter.wait_for_capacity/5` accepts before it answers
# `{:error, %Bourse.Error{type: :rate_limit_exceeded}}` (see `Bourse.Defaults`).
config :bourse, rate_limit_max_wait_ms: 30_000
