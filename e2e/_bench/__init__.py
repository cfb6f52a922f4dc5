"""The benchmarks behind ``midflight bench``."""
