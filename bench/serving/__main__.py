"""``python -m bench.serving``: the serving load generator (bench/serving/client.py)."""

from bench.serving.client import main

if __name__ == "__main__":
    main()
