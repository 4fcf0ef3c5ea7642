// An answer's text cut into whole sentences as it streams in, for a game that speaks each one (text to speech wants
// a sentence, not a token): a sentence ends with . ! ? or … followed by whitespace, or with a newline; the text after
// the last such end is the remainder, handed on when the answer ends. The sentences joined are the text fed.
#pragma once

#include <string>
#include <vector>

namespace pipeshard {

class SentenceSplitter {
public:
    // Append a piece of the answer (UTF-8, any cut, even inside a character); the sentences it completes.
    std::vector<std::string> feed(const std::string& piece);
    // The text after the last complete sentence (maybe empty or only whitespace); the splitter starts over.
    std::string finish();

private:
    std::string pending_;  // fed, not yet handed on as a sentence
    size_t scanned_ = 0;   // no sentence of pending_ ends before this byte
};

}  // namespace pipeshard
