"""``python -m stepkernels.sample``: text from a trained GPT's checkpoint (``stepkernels.models.sample``)."""

from stepkernels.models.sample import main

if __name__ == "__main__":
    main()
