// The host's image preprocessing (src/images.cpp) from the command line, for tests/test_native_host_images.py, which
// compares what it writes with Pillow's resize and runtime/images.py's pixels.
//   image_check resize IN.rgb WIDTH HEIGHT NEW_WIDTH NEW_HEIGHT FILTER OUT.rgb
//   image_check preprocess MANIFEST_JSON OUT.f32 IN.rgb WIDTH HEIGHT [IN.rgb WIDTH HEIGHT]...
// Files are raw: 8-bit RGB rows; float32 pixel_values [tiles, 3, size, size]. `preprocess` prints one JSON object
// (tiles, size, rows, cols, image_tokens, each image's token run). Failures: one line on stderr, status 2.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "errors.hpp"
#include "images.hpp"

using namespace pipeshard;

namespace {

RgbImage read_rgb(const std::string& path, const char* width, const char* height) {
    RgbImage image;
    image.width = std::atoi(width);
    image.height = std::atoi(height);
    std::ifstream in(path, std::ios::binary);
    image.pixels.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (image.pixels.size() != static_cast<size_t>(image.width) * image.height * 3)
        fail(PIPESHARD_ERR_ARGUMENT, path + " does not hold " + width + "x" + height + " RGB pixels");
    return image;
}

void write(const std::string& path, const void* data, size_t bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    if (!out) fail(PIPESHARD_ERR_ARGUMENT, "cannot write " + path);
}

std::string quoted(const std::string& text) {
    std::string out = "\"";
    for (char c : text) {
        if (c == '"' || c == '\\') out += '\\';
        if (c == '\n') {
            out += "\\n";
            continue;
        }
        out += c;
    }
    return out + "\"";
}

template <typename List>
std::string list(const List& values) {
    std::string out = "[";
    for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
    return out + "]";
}

int run(int argc, char** argv) {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "resize" && argc == 9) {
        RgbImage image = read_rgb(argv[2], argv[3], argv[4]);
        RgbImage out = resize(image, std::atoi(argv[5]), std::atoi(argv[6]), filter_named(argv[7]));
        write(argv[8], out.pixels.data(), out.pixels.size());
        return 0;
    }
    if (mode == "preprocess" && argc >= 7 && (argc - 4) % 3 == 0) {
        Json manifest = Json::parse(read_file(argv[2]));
        ImageConfig config = ImageConfig::from(manifest.at("vision").at("preprocessing"));
        std::vector<RgbImage> images;
        for (int i = 4; i < argc; i += 3) images.push_back(read_rgb(argv[i], argv[i + 1], argv[i + 2]));
        ImageInputs inputs = preprocess(images, config);
        write(argv[3], inputs.pixels.data(), inputs.pixels.size() * sizeof(float));
        std::string texts = "[";
        for (size_t i = 0; i < images.size(); ++i) texts += (i ? ", " : "") + quoted(image_text(inputs, i, config));
        std::printf("{\"tiles\": %lld, \"size\": %lld, \"rows\": %s, \"cols\": %s, \"image_tokens\": %s, "
                    "\"texts\": %s]}\n",
                    static_cast<long long>(inputs.tiles), static_cast<long long>(inputs.size),
                    list(inputs.rows).c_str(), list(inputs.cols).c_str(), list(inputs.image_tokens).c_str(),
                    texts.c_str());
        return 0;
    }
    std::fprintf(stderr, "usage: image_check resize IN.rgb W H NEW_W NEW_H FILTER OUT.rgb | preprocess MANIFEST "
                         "OUT.f32 IN.rgb W H...\n");
    return 2;
}

}  // namespace

int main(int argc, char** argv) {
    std::string error;
    int status = 0;
    if (guarded(error, [&] { status = run(argc, argv); }) != PIPESHARD_OK) {
        std::fprintf(stderr, "error: %s\n", error.c_str());
        return 2;
    }
    return status;
}
