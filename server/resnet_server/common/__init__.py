"""What every process of the server shares: configuration, errors, logging, metric definitions, the model's identity,
and the value types of an image and its result."""
