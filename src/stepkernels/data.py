"""``python -m stepkernels.data``: prepare the GPT's training data (``stepkernels.models.data``)."""

from stepkernels.models.data import main

if __name__ == "__main__":
    main()
