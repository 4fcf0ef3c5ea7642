// Image preprocessing of VLM packs (images.hpp): what runtime/images.py computes, byte for byte.
#include "images.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "errors.hpp"

namespace pipeshard {

namespace {

constexpr double kPi = 3.14159265358979323846;
// Pillow's fixed point for 8-bit images: 8 bits of result, 2 of headroom for filters with negative lobes.
constexpr int kPrecisionBits = 32 - 8 - 2;
constexpr int kLargestEdge = 1 << 15;  // a larger image is a caller's mistake, not a picture

double sinc(double x) {
    if (x == 0.0) return 1.0;
    x *= kPi;
    return std::sin(x) / x;
}

// Each filter's weight at distance x (in source pixels, scaled for a downscale), and how far it reaches.
double filter_weight(Filter filter, double x) {
    switch (filter) {
        case Filter::Box:
            return x > -0.5 && x <= 0.5 ? 1.0 : 0.0;
        case Filter::Bilinear:
            x = std::fabs(x);
            return x < 1.0 ? 1.0 - x : 0.0;
        case Filter::Hamming:
            x = std::fabs(x);
            if (x == 0.0) return 1.0;
            if (x >= 1.0) return 0.0;
            x *= kPi;
            // Pillow's window constants are single-precision literals, widened.
            return std::sin(x) / x * (static_cast<double>(0.54f) + static_cast<double>(0.46f) * std::cos(x));
        case Filter::Bicubic: {
            constexpr double a = -0.5;
            x = std::fabs(x);
            if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
            if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
            return 0.0;
        }
        case Filter::Lanczos:
            return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0;
    }
    return 0.0;
}

double filter_support(Filter filter) {
    switch (filter) {
        case Filter::Box: return 0.5;
        case Filter::Bilinear: case Filter::Hamming: return 1.0;
        case Filter::Bicubic: return 2.0;
        case Filter::Lanczos: return 3.0;
    }
    return 1.0;
}

// One axis of a resize: for each output pixel, its first source pixel, how many it reads, and their fixed-point
// weights (`taps` per output pixel).
struct Taps {
    int taps = 0;
    std::vector<int> first, count;
    std::vector<int32_t> weights;
};

Taps axis_taps(int in_size, int out_size, Filter filter) {
    // Pillow takes the source box as floats; whole sizes are exact in them.
    double scale = static_cast<double>(static_cast<float>(in_size)) / out_size;
    double filter_scale = std::max(scale, 1.0);
    double support = filter_support(filter) * filter_scale;
    Taps taps;
    taps.taps = static_cast<int>(std::ceil(support)) * 2 + 1;
    taps.first.resize(static_cast<size_t>(out_size));
    taps.count.resize(static_cast<size_t>(out_size));
    taps.weights.assign(static_cast<size_t>(out_size) * static_cast<size_t>(taps.taps), 0);
    std::vector<double> weights(static_cast<size_t>(taps.taps));
    for (int out = 0; out < out_size; ++out) {
        double center = (out + 0.5) * scale;
        double inverse = 1.0 / filter_scale;
        int first = std::max(static_cast<int>(center - support + 0.5), 0);
        int last = std::min(static_cast<int>(center + support + 0.5), in_size);
        int count = last - first;
        double sum = 0.0;
        for (int k = 0; k < count; ++k) {
            weights[static_cast<size_t>(k)] = filter_weight(filter, (k + first - center + 0.5) * inverse);
            sum += weights[static_cast<size_t>(k)];
        }
        int32_t* fixed = &taps.weights[static_cast<size_t>(out) * static_cast<size_t>(taps.taps)];
        for (int k = 0; k < count; ++k) {
            double weight = weights[static_cast<size_t>(k)];
            if (sum != 0.0) weight /= sum;
            // Rounded half away from zero into the fixed point.
            double scaled = weight * (1 << kPrecisionBits);
            fixed[k] = static_cast<int32_t>(weight < 0 ? scaled - 0.5 : scaled + 0.5);
        }
        taps.first[static_cast<size_t>(out)] = first;
        taps.count[static_cast<size_t>(out)] = std::max(count, 0);
    }
    return taps;
}

// A fixed-point sum back to a byte: the half added up front rounds; beyond the range clips.
uint8_t to_byte(int32_t sum) {
    if (sum < 0) return 0;
    return static_cast<uint8_t>(std::min(sum >> kPrecisionBits, 255));
}

std::vector<float> rescaled_and_normalized(const RgbImage& image, const ImageConfig& config) {
    // Channels first; rescale in double and round to float, normalize in float, as the processor's numpy does.
    size_t plane = static_cast<size_t>(image.width) * static_cast<size_t>(image.height);
    std::vector<float> out(plane * 3);
    for (size_t channel = 0; channel < 3; ++channel) {
        float* target = out.data() + channel * plane;
        for (size_t i = 0; i < plane; ++i) {
            uint8_t byte = image.pixels[i * 3 + channel];
            float value = config.do_rescale ? static_cast<float>(static_cast<double>(byte) * config.rescale_factor)
                                            : static_cast<float>(byte);
            if (config.do_normalize) value = (value - config.mean[channel]) / config.std[channel];
            target[i] = value;
        }
    }
    return out;
}

// Rows [top, top + size) and columns [left, left + size) of channels-first pixels `width` wide, appended to `out`.
void append_tile(const std::vector<float>& pixels, int width, int height, int top, int left, int size,
                 std::vector<float>& out) {
    size_t plane = static_cast<size_t>(width) * static_cast<size_t>(height);
    for (size_t channel = 0; channel < 3; ++channel)
        for (int row = top; row < top + size; ++row) {
            const float* start = pixels.data() + channel * plane + static_cast<size_t>(row) * width + left;
            out.insert(out.end(), start, start + size);
        }
}

int number(const Json& config, const char* key, int least) {
    const Json& value = config.at(key);
    int64_t got = value.integer();
    if (got < least || got > kLargestEdge * 4)
        throw JsonError(std::string("vision.preprocessing.") + key + " is out of range");
    return static_cast<int>(got);
}

int optional_number(const Json& config, const char* key) {
    return config.has(key) && !config.at(key).is_null() ? number(config, key, 1) : 0;
}

void check_size(int height, int width) {
    if (height < 1 || width < 1)
        fail(PIPESHARD_ERR_ARGUMENT, "the image is too elongated for this model (it would resize to " +
                                         std::to_string(width) + "x" + std::to_string(height) + " pixels)");
}

// --- Idefics3 / SmolVLM: longest edge resized, then both edges to whole tiles, cut into tiles plus a global view.

std::pair<int, int> idefics3_resized_size(int height, int width, const ImageConfig& config) {
    double aspect = static_cast<double>(width) / height;
    if (width >= height) {
        width = config.longest_edge;
        height = static_cast<int>(width / aspect);
        height += height % 2;
    } else {
        height = config.longest_edge;
        width = static_cast<int>(height * aspect);
        width += width % 2;
    }
    height = std::max(height, 1);
    width = std::max(width, 1);
    aspect = static_cast<double>(width) / height;
    int cap = config.max_resolution;
    if (width >= height && width > cap) {
        width = cap;
        height = static_cast<int>(width / aspect);
    } else if (height > width && height > cap) {
        height = cap;
        width = static_cast<int>(height * aspect);
    }
    return {std::max(height, 1), std::max(width, 1)};
}

std::pair<int, int> idefics3_tiled_size(int height, int width, const ImageConfig& config) {
    double aspect = static_cast<double>(width) / height, tile = config.tile;
    if (width >= height) {
        width = static_cast<int>(std::ceil(width / tile) * tile);
        height = static_cast<int>(std::ceil(static_cast<int>(width / aspect) / tile) * tile);
    } else {
        height = static_cast<int>(std::ceil(height / tile) * tile);
        width = static_cast<int>(std::ceil(static_cast<int>(height * aspect) / tile) * tile);
    }
    return {height, width};
}

void preprocess_idefics3(const RgbImage& source, const ImageConfig& config, ImageInputs& inputs) {
    const int tile = config.tile;
    RgbImage image = source;
    if (config.do_resize) {
        auto [height, width] = idefics3_resized_size(image.height, image.width, config);
        image = resize(image, width, height, config.filter);
    }
    auto single = [&](const RgbImage& view) {
        std::vector<float> pixels = rescaled_and_normalized(view, config);
        inputs.pixels.insert(inputs.pixels.end(), pixels.begin(), pixels.end());
        inputs.tiles += 1;
        inputs.rows.push_back(0);
        inputs.cols.push_back(0);
        inputs.image_tokens.push_back(config.image_seq_len);
    };
    if (!config.do_image_splitting) return single(resize(image, tile, tile, config.filter));
    auto [height, width] = idefics3_tiled_size(image.height, image.width, config);
    check_size(height, width);
    image = resize(image, width, height, config.filter);
    if (image.height <= tile && image.width <= tile) return single(image);
    std::vector<float> pixels = rescaled_and_normalized(image, config);
    int rows = image.height / tile, cols = image.width / tile;
    for (int row = 0; row < rows; ++row)
        for (int col = 0; col < cols; ++col)
            append_tile(pixels, image.width, image.height, row * tile, col * tile, tile, inputs.pixels);
    std::vector<float> global = rescaled_and_normalized(resize(image, tile, tile, config.filter), config);
    inputs.pixels.insert(inputs.pixels.end(), global.begin(), global.end());
    inputs.tiles += static_cast<int64_t>(rows) * cols + 1;
    inputs.rows.push_back(rows);
    inputs.cols.push_back(cols);
    inputs.image_tokens.push_back(config.image_seq_len * (static_cast<int64_t>(rows) * cols + 1));
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
    for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
        text.replace(at, from.size(), to);
    return text;
}

std::string idefics3_text(int rows, int cols, const ImageConfig& config) {
    std::string run;
    for (int64_t i = 0; i < config.image_seq_len; ++i) run += config.image_token;
    std::string global = config.fake_image_token + config.global_image_token + run + config.fake_image_token;
    if (rows == 0) return global;
    std::string text;
    for (int row = 1; row <= rows; ++row) {
        for (int col = 1; col <= cols; ++col)
            text += config.fake_image_token +
                    replace_all(replace_all(config.row_col_token, "{row}", std::to_string(row)), "{col}",
                                std::to_string(col)) +
                    run;
        text += "\n";
    }
    return text + "\n" + global;
}

// --- A CLIP / SigLIP tower (family llava): shortest edge (or a fixed size), center crop, one image one tile.

RgbImage center_crop(const RgbImage& image, int height, int width) {
    // The processor pads an image smaller than the crop with zeros around it, then takes the middle.
    auto floor_half = [](int difference) { return difference >= 0 ? difference / 2 : -((-difference + 1) / 2); };
    int top = floor_half(image.height - height), left = floor_half(image.width - width);
    RgbImage out;
    out.width = width;
    out.height = height;
    out.pixels.assign(static_cast<size_t>(width) * height * 3, 0);
    for (int row = 0; row < height; ++row)
        for (int col = 0; col < width; ++col) {
            int source_row = row + top, source_col = col + left;
            if (source_row < 0 || source_row >= image.height || source_col < 0 || source_col >= image.width) continue;
            const uint8_t* from = &image.pixels[(static_cast<size_t>(source_row) * image.width + source_col) * 3];
            std::copy(from, from + 3, &out.pixels[(static_cast<size_t>(row) * width + col) * 3]);
        }
    return out;
}

void preprocess_llava(const RgbImage& source, const ImageConfig& config, ImageInputs& inputs) {
    RgbImage image = source;
    if (config.do_resize) {
        int height = config.fixed_height, width = config.fixed_width;
        if (config.shortest_edge) {
            int edge = config.shortest_edge;
            int shorter = std::min(image.width, image.height), longer = std::max(image.width, image.height);
            int new_long = static_cast<int>(static_cast<double>(static_cast<int64_t>(edge) * longer) / shorter);
            height = image.width <= image.height ? new_long : edge;
            width = image.width <= image.height ? edge : new_long;
        }
        check_size(height, width);
        image = resize(image, width, height, config.filter);
    }
    if (config.crop_height) image = center_crop(image, config.crop_height, config.crop_width);
    if (image.width != config.image_size || image.height != config.image_size)
        fail(PIPESHARD_ERR_ARGUMENT, "an image of " + std::to_string(image.width) + "x" + std::to_string(image.height) +
                                         " pixels; this model takes " + std::to_string(config.image_size) + "x" +
                                         std::to_string(config.image_size));
    std::vector<float> pixels = rescaled_and_normalized(image, config);
    inputs.pixels.insert(inputs.pixels.end(), pixels.begin(), pixels.end());
    inputs.tiles += 1;
    inputs.image_tokens.push_back(config.image_seq_len);
}

}  // namespace

Filter filter_named(const std::string& name) {
    if (name == "BOX") return Filter::Box;
    if (name == "BILINEAR") return Filter::Bilinear;
    if (name == "HAMMING") return Filter::Hamming;
    if (name == "BICUBIC") return Filter::Bicubic;
    if (name == "LANCZOS") return Filter::Lanczos;
    fail(PIPESHARD_ERR_PACK, "the pack's image preprocessing resamples with " + name +
                                 ", which this host does not (BOX, BILINEAR, HAMMING, BICUBIC, LANCZOS)");
}

namespace {

// The horizontal pass: every row of `image` resampled to `width` columns.
RgbImage resize_across(const RgbImage& image, int width, Filter filter) {
    Taps taps = axis_taps(image.width, width, filter);
    RgbImage out;
    out.width = width;
    out.height = image.height;
    out.pixels.assign(static_cast<size_t>(width) * static_cast<size_t>(image.height) * 3, 0);
    for (int row = 0; row < image.height; ++row) {
        const uint8_t* in = &image.pixels[static_cast<size_t>(row) * image.width * 3];
        uint8_t* target = &out.pixels[static_cast<size_t>(row) * width * 3];
        for (int col = 0; col < width; ++col) {
            const int32_t* weights = &taps.weights[static_cast<size_t>(col) * static_cast<size_t>(taps.taps)];
            int first = taps.first[static_cast<size_t>(col)], count = taps.count[static_cast<size_t>(col)];
            for (int channel = 0; channel < 3; ++channel) {
                int32_t sum = 1 << (kPrecisionBits - 1);
                for (int k = 0; k < count; ++k) sum += in[(first + k) * 3 + channel] * weights[k];
                target[col * 3 + channel] = to_byte(sum);
            }
        }
    }
    return out;
}

// The vertical pass: every column of `image` resampled to `height` rows.
RgbImage resize_down(const RgbImage& image, int height, Filter filter) {
    Taps taps = axis_taps(image.height, height, filter);
    RgbImage out;
    out.width = image.width;
    out.height = height;
    size_t stride = static_cast<size_t>(image.width) * 3;
    out.pixels.assign(stride * static_cast<size_t>(height), 0);
    for (int row = 0; row < height; ++row) {
        const int32_t* weights = &taps.weights[static_cast<size_t>(row) * static_cast<size_t>(taps.taps)];
        int first = taps.first[static_cast<size_t>(row)], count = taps.count[static_cast<size_t>(row)];
        uint8_t* target = &out.pixels[static_cast<size_t>(row) * stride];
        for (size_t column = 0; column < stride; ++column) {
            int32_t sum = 1 << (kPrecisionBits - 1);
            for (int k = 0; k < count; ++k)
                sum += image.pixels[static_cast<size_t>(first + k) * stride + column] * weights[k];
            target[column] = to_byte(sum);
        }
    }
    return out;
}

}  // namespace

RgbImage resize(const RgbImage& image, int width, int height, Filter filter) {
    if (width < 1 || height < 1 || width > kLargestEdge || height > kLargestEdge)
        fail(PIPESHARD_ERR_ARGUMENT, "cannot resize to " + std::to_string(width) + "x" + std::to_string(height));
    // Each pass rounds to bytes, so their order shows in the result. Pillow 13 passes vertically first when the
    // height loses more than twice the pixels the width does (python-pillow/Pillow#9549), else horizontally first;
    // a size that does not change skips its pass.
    bool vertical_first = height < image.height && image.height - height > 2 * (image.width - width);
    RgbImage out = image;
    if (vertical_first) out = resize_down(out, height, filter);
    if (width != out.width) out = resize_across(out, width, filter);
    if (height != out.height) out = resize_down(out, height, filter);
    return out;
}

ImageConfig ImageConfig::from(const Json& preprocessing) {
    ImageConfig config;
    try {
        if (preprocessing.at("schema_version").integer() != 1)
            fail(PIPESHARD_ERR_PACK, "the pack's image preprocessing has schema_version " +
                                         std::to_string(preprocessing.at("schema_version").integer()) +
                                         "; this host reads 1 (re-export the pack)");
        config.family = preprocessing.at("family").str();
        if (config.family == "qwen2_vl" || config.family == "gemma3")
            fail(PIPESHARD_ERR_ARGUMENT, "this host takes images for SmolVLM / Idefics3 and llava-style packs; a " +
                                             config.family + " pack's images are not supported yet (use pipeshard "
                                             "run)");
        if (config.family != "idefics3" && config.family != "llava")
            fail(PIPESHARD_ERR_PACK, "the pack's image preprocessing family '" + config.family + "' is not known");
        config.filter = filter_named(preprocessing.at("resample").str());
        config.do_resize = preprocessing.at("do_resize").boolean;
        config.do_rescale = preprocessing.at("do_rescale").boolean;
        config.do_normalize = preprocessing.at("do_normalize").boolean;
        if (config.do_rescale) config.rescale_factor = preprocessing.at("rescale_factor").real();
        if (config.do_normalize)
            for (size_t channel = 0; channel < 3; ++channel) {
                config.mean[channel] = static_cast<float>(preprocessing.at("image_mean").at(channel).real());
                config.std[channel] = static_cast<float>(preprocessing.at("image_std").at(channel).real());
            }
        config.image_token = preprocessing.at("image_token").str();
        if (config.image_token.empty()) throw JsonError("vision.preprocessing.image_token is empty");
        config.image_seq_len = number(preprocessing, "image_seq_len", 1);
        if (config.family == "idefics3") {
            config.longest_edge = number(preprocessing, "longest_edge", 1);
            config.max_resolution = number(preprocessing, "max_resolution", 1);
            config.tile = number(preprocessing, "max_image_size", 1);
            config.do_image_splitting = preprocessing.at("do_image_splitting").boolean;
            config.fake_image_token = preprocessing.at("fake_image_token").str();
            config.global_image_token = preprocessing.at("global_image_token").str();
            config.row_col_token = preprocessing.at("row_col_token").str();
        } else {
            config.image_size = number(preprocessing, "image_size", 1);
            config.shortest_edge = optional_number(preprocessing, "shortest_edge");
            config.fixed_height = optional_number(preprocessing, "height");
            config.fixed_width = optional_number(preprocessing, "width");
            config.crop_height = optional_number(preprocessing, "crop_height");
            config.crop_width = optional_number(preprocessing, "crop_width");
            if (!config.shortest_edge && !(config.fixed_height && config.fixed_width))
                throw JsonError("vision.preprocessing has neither shortest_edge nor height and width");
            if (!config.crop_height != !config.crop_width)
                throw JsonError("vision.preprocessing has only one of crop_height and crop_width");
        }
    } catch (const JsonError& error) {
        fail(PIPESHARD_ERR_PACK, std::string("the pack's vision.preprocessing: ") + error.what());
    }
    return config;
}

ImageInputs preprocess(const std::vector<RgbImage>& images, const ImageConfig& config) {
    ImageInputs inputs;
    inputs.size = config.family == "idefics3" ? config.tile : config.image_size;
    for (const RgbImage& image : images) {
        if (config.family == "idefics3") {
            preprocess_idefics3(image, config, inputs);
        } else {
            preprocess_llava(image, config, inputs);
        }
    }
    return inputs;
}

std::string image_text(const ImageInputs& inputs, size_t index, const ImageConfig& config) {
    if (config.family == "idefics3") return idefics3_text(inputs.rows[index], inputs.cols[index], config);
    std::string run;
    for (int64_t i = 0; i < inputs.image_tokens[index]; ++i) run += config.image_token;
    return run;
}

namespace {

size_t occurrences(const std::string& text, const std::string& what) {
    size_t count = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++count;
    return count;
}

}  // namespace

std::string with_placeholders(const std::string& prompt, size_t images, const ImageConfig& config) {
    size_t written = occurrences(prompt, config.image_token);
    if (written == 0) {
        std::string text;
        for (size_t i = 0; i < images; ++i) text += config.image_token;
        return text + prompt;
    }
    if (written != images)
        fail(PIPESHARD_ERR_ARGUMENT, "the prompt has " + std::to_string(written) + " image placeholder(s) '" +
                                         config.image_token + "' but " + std::to_string(images) +
                                         " image(s) were given");
    return prompt;
}

std::string expand_image_tokens(const std::string& text, const ImageInputs& inputs, const ImageConfig& config) {
    std::string out;
    size_t start = 0, index = 0;
    for (size_t at = text.find(config.image_token); at != std::string::npos;
         at = text.find(config.image_token, start)) {
        if (index >= inputs.image_tokens.size())
            fail(PIPESHARD_ERR_ARGUMENT, "the prompt has more image placeholders than the " +
                                             std::to_string(inputs.image_tokens.size()) + " image(s) given");
        out += text.substr(start, at - start) + image_text(inputs, index++, config);
        start = at + config.image_token.size();
    }
    if (index != inputs.image_tokens.size())
        fail(PIPESHARD_ERR_ARGUMENT, "the prompt has " + std::to_string(index) + " image placeholder(s) but " +
                                         std::to_string(inputs.image_tokens.size()) + " image(s) were given");
    return out + text.substr(start);
}

}  // namespace pipeshard
