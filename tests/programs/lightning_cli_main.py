"""Lightning's LightningCLI example, as its docs give it ("Configure hyperparameters from the CLI (Intermediate)",
https://lightning.ai/docs/pytorch/stable/cli/lightning_cli_intermediate.html: ``main.py``, ``LightningCLI(DemoModel,
BoringDataModule)`` from ``lightning.pytorch.demos.boring_classes``, fit not called by hand), run as the docs run it:
``python main.py fit --config config.yaml``. Unedited; it never imports runner."""

# main.py
from lightning.pytorch.cli import LightningCLI

# simple demo classes for your convenience
from lightning.pytorch.demos.boring_classes import BoringDataModule, DemoModel


def cli_main():
    cli = LightningCLI(DemoModel, BoringDataModule)  # noqa: F841 -- the docs' line
    # note: don't call fit!!


if __name__ == "__main__":
    cli_main()
    # note: it is good practice to implement the CLI in a function and call it in the main if block
