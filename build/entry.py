"""PyInstaller entry point of the one-file executable: the appliance's command line."""
import sys

from appliance.cli import main

if __name__ == "__main__":
    sys.exit(main())
