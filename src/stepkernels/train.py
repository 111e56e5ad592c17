"""``python -m stepkernels.train``: train chapter 12's GPT (``stepkernels.models.train``)."""

from stepkernels.models.train import main

if __name__ == "__main__":
    main()
