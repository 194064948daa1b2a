"""Learning from served traffic: the adapt loop (adapt_loop.py) and the bench that shows it over a stream of requests
(adapt_bench.py)."""
