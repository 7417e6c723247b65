"""``python -m kvq_export.cli``."""

from kvq_export.cli import main

if __name__ == "__main__":
    main()
