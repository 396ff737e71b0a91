"""`moeserve bench ...`: benchmarks that run against a live server (bench serve)."""
