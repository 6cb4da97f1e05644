"""Mistral 3 / Pixtral's processor where transformers' own cannot be imported.

transformers' `PixtralProcessor` requires torchvision (its module imports the torchvision image
processor), which a CPU machine with a CPU torch does not have: the PyPI torchvision wheel is a CUDA
build. Where torchvision exists, `multimodal.load_processor` returns transformers' processor; where it
does not, it returns `PixtralPilProcessor`: transformers' PIL image processor for Pixtral plus the
placeholder expansion of transformers/models/pixtral/processing_pixtral.py (transformers 5.24), mirrored
line for line below, so serving, `bulkgen plan` and the tests prepare a Mistral 3 prompt the same way.
"""

from __future__ import annotations

import numpy as np
from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size
from transformers.processing_utils import MultiModalData, ProcessorMixin
from transformers.utils import is_torchvision_available

from bulkgen.engine.features.image_only import processor_class


class PixtralPilProcessor(ProcessorMixin):
    """transformers' PixtralProcessor (processing_pixtral.py) over `PixtralImageProcessorPil`: an image
    becomes rows of `[IMG]` tokens, `[IMG_BREAK]` after each row, the last one `[IMG_END]`. It saves as
    `PixtralProcessor`, so a folder it wrote loads with transformers' processor where torchvision exists."""

    text_kwargs = {"return_tensors": "pt"}
    images_kwargs = {"return_tensors": "pt"}

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        patch_size: int = 16,
        spatial_merge_size: int = 1,
        chat_template=None,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
        **kwargs,
    ) -> None:
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token = image_token
        self.image_break_token = image_break_token
        self.image_end_token = image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.image_break_token_id = tokenizer.convert_tokens_to_ids(self.image_break_token)
        self.image_end_token_id = tokenizer.convert_tokens_to_ids(self.image_end_token)

    @property
    def image_token_ids(self) -> list[int]:
        return [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

    def _process_images(self, images, **images_kwargs):
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """The placeholder text of image `image_idx`: its (resized) height in merged patches of rows, each
        row its width in `[IMG]` tokens and an `[IMG_BREAK]`; the last token `[IMG_END]`."""
        patch_size = self.patch_size * self.spatial_merge_size
        height, width = image_inputs["image_sizes"][image_idx]
        num_height_tokens = height // patch_size
        num_width_tokens = width // patch_size
        replace_tokens = [
            [self.image_token] * num_width_tokens + [self.image_break_token]
        ] * num_height_tokens
        replace_tokens = [item for sublist in replace_tokens for item in sublist]
        replace_tokens[-1] = self.image_end_token
        return "".join(replace_tokens)

    def _get_num_multimodal_tokens(self, image_sizes=None, **kwargs) -> MultiModalData:
        """`[IMG]` placeholder tokens per image of each (height, width), as transformers counts them from 5.25
        on (earlier releases counted each row's `[IMG_BREAK]`/`[IMG_END]` too, which matched no placeholder
        count: multimodal._counts then fell back to none)."""
        vision_data = {}
        if image_sizes is not None:
            # the one images setting the count reads (ProcessorMixin._merge_kwargs' signature differs by release)
            size = kwargs.get("size") or self.image_processor.size
            patch_size = self.patch_size * self.spatial_merge_size
            num_image_tokens = []
            for height, width in image_sizes:
                resized_height, resized_width = get_resize_output_image_size(
                    np.zeros((height, width, 3)),
                    size=(size["longest_edge"], size["longest_edge"]),
                    patch_size=(patch_size, patch_size),
                )
                num_height_tokens = resized_height // patch_size
                num_width_tokens = resized_width // patch_size
                num_image_tokens.append(num_width_tokens * num_height_tokens)
            num_image_patches = [1] * len(image_sizes)
            vision_data.update({"num_image_tokens": num_image_tokens, "num_image_patches": num_image_patches})
        return MultiModalData(**vision_data)

    @property
    def model_input_names(self) -> list[str]:
        tokenizer_input_names = self.tokenizer.model_input_names
        image_processor_input_names = self.image_processor.model_input_names
        return tokenizer_input_names + image_processor_input_names + ["image_sizes"]

    def to_dict(self) -> dict:
        """The saved processor_config names transformers' class, which this one stands in for."""
        return {**super().to_dict(), "processor_class": "PixtralProcessor"}


def load_mirror(path: str) -> PixtralPilProcessor | None:
    """The mirror loaded from `path` where its checkpoint names PixtralProcessor and transformers cannot
    import that for want of torchvision; None otherwise (AutoProcessor then loads the checkpoint's own)."""
    if is_torchvision_available() or processor_class(path) != "PixtralProcessor":
        return None
    return PixtralPilProcessor.from_pretrained(path, local_files_only=True)


def pixtral_processor(image_processor, tokenizer, **settings):
    """A Pixtral processor over these parts: transformers' where torchvision exists, else the mirror."""
    if is_torchvision_available():
        from transformers import PixtralProcessor

        return PixtralProcessor(image_processor, tokenizer, **settings)
    return PixtralPilProcessor(image_processor, tokenizer, **settings)
