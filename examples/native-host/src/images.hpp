// A VLM pack's image preprocessing in C++, as runtime/images.py does it with Pillow and numpy (docs/native-host.md,
// "Images"): Pillow's resampling of 8-bit images (the same coefficients, fixed point and rounding, so the pixels are
// the same bytes), the family's tiling, then rescale and normalize in the processor's float arithmetic; and the
// prompt's image placeholders expanded into each image's token run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "json.hpp"

namespace pipeshard {

// Pillow's resampling filters (Image.Resampling), by the names the pack's preprocessing config gives.
enum class Filter { Box, Bilinear, Hamming, Bicubic, Lanczos };

// Throws HostError(PIPESHARD_ERR_PACK) for a name Pillow resamples otherwise (NEAREST) or does not have.
Filter filter_named(const std::string& name);

// An 8-bit RGB image: height rows of width pixels of 3 bytes, no padding.
struct RgbImage {
    int width = 0, height = 0;
    std::vector<uint8_t> pixels;
};

// Image.resize((width, height), filter) of an RGB image: a horizontal pass, then a vertical one, each output pixel
// the sum of its source pixels times fixed-point coefficients, rounded and clipped to 8 bits as Pillow does.
RgbImage resize(const RgbImage& image, int width, int height, Filter filter);

// vision.preprocessing of the manifest (exporter/image_processing.py writes it): what the host needs of it.
struct ImageConfig {
    std::string family;  // idefics3 | llava (gemma3 and qwen2_vl packs are refused)
    Filter filter = Filter::Bicubic;
    bool do_resize = true, do_rescale = true, do_normalize = true;
    double rescale_factor = 1.0;
    float mean[3] = {0, 0, 0}, std[3] = {1, 1, 1};
    std::string image_token;
    int64_t image_seq_len = 0;
    // idefics3
    int longest_edge = 0, max_resolution = 0, tile = 0;
    bool do_image_splitting = false;
    std::string fake_image_token, global_image_token, row_col_token;
    // llava
    int image_size = 0, shortest_edge = 0, fixed_height = 0, fixed_width = 0, crop_height = 0, crop_width = 0;

    // Throws HostError(PIPESHARD_ERR_ARGUMENT) for a family this host does not preprocess, PACK for a bad config.
    static ImageConfig from(const Json& preprocessing);
};

// The vision graph's pixel_values for one prompt's images, and how each image lays out in the prompt.
struct ImageInputs {
    std::vector<float> pixels;  // [tiles, 3, size, size]: every image's tiles in order (idefics3: global view last)
    int64_t tiles = 0, size = 0;
    std::vector<int> rows, cols;            // idefics3: tile rows and columns per image (0: not split)
    std::vector<int64_t> image_tokens;      // image-token positions (= feature rows) per image
};

ImageInputs preprocess(const std::vector<RgbImage>& images, const ImageConfig& config);

// Image i's run of tokens in the prompt, as the transformers processor writes it.
std::string image_text(const ImageInputs& inputs, size_t index, const ImageConfig& config);

// The prompt with one placeholder per image: as written where it has them, else all before its text. Throws
// HostError(PIPESHARD_ERR_ARGUMENT) when it holds some placeholders but not one per image.
std::string with_placeholders(const std::string& prompt, size_t images, const ImageConfig& config);

// `text` with its i-th placeholder replaced by image i's token run.
std::string expand_image_tokens(const std::string& text, const ImageInputs& inputs, const ImageConfig& config);

}  // namespace pipeshard
