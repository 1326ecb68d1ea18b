"""What lies between a front-end and an engine: the shared slab and the typed messages."""
