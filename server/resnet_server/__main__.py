import sys

from resnet_server.cli import main

if __name__ == "__main__":  # spawned engines and front-ends import this module again without running it
    sys.exit(main())
