import sys

from sglang.train_tiny_pair.train import main

sys.exit(main())
