"""The supervisor: the children's lives (start, replace, drain) and the one merged /metrics."""
