"""A descriptor pool of its own for the Open Inference Protocol messages (package ``inference``).

tritonclient registers the same message names from other .proto file names in the default pool;
keeping ours apart lets a process import both (the tests drive our server with tritonclient).
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
