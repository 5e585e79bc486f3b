// libsodium behind the interface of crypto.h. Every MAC and derivation is keyed
// BLAKE2b-256 (crypto_generichash) over a label and length-prefixed inputs, so that no
// two different input lists hash the same bytes.
#include "security/crypto.h"

#include <sodium.h>

#include <fstream>
#include <iterator>
#include <mutex>

namespace lockstep::security {
namespace {

static_assert(crypto_generichash_KEYBYTES_MAX >= kKeyBytes && crypto_generichash_BYTES_MIN <= kKeyBytes);
static_assert(crypto_aead_chacha20poly1305_ietf_KEYBYTES == kKeyBytes);
static_assert(crypto_aead_chacha20poly1305_ietf_ABYTES == kTagBytes);

// The fixed context under which a secret's bytes become the secret key.
constexpr std::string_view kSecretContext = "lockstep run secret, key derivation v1";

class Hasher {
 public:
  Hasher(std::span<const std::uint8_t> key, std::string_view label) {
    crypto_generichash_init(&state_, key.data(), key.size(), kKeyBytes);
    add(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(label.data()), label.size()));
  }
  Hasher& add(std::span<const std::uint8_t> bytes) {
    std::uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(bytes.size()) >> (8 * i));
    crypto_generichash_update(&state_, length, sizeof length);
    crypto_generichash_update(&state_, bytes.data(), bytes.size());
    return *this;
  }
  Hasher& add(PeerId id) {
    std::uint8_t raw[16];
    for (int i = 0; i < 8; ++i) {
      raw[i] = static_cast<std::uint8_t>(id.hi >> (8 * i));
      raw[8 + i] = static_cast<std::uint8_t>(id.lo >> (8 * i));
    }
    return add(std::span<const std::uint8_t>(raw, sizeof raw));
  }
  Key finish() {
    Key out{};
    crypto_generichash_final(&state_, out.data(), out.size());
    return out;
  }

 private:
  crypto_generichash_state state_{};
};

Hasher handshake_hash(const Key& key, std::string_view label, const Nonce& client, const Nonce& server,
                      std::span<const std::uint8_t> transcript) {
  Hasher h(key, label);
  h.add(client).add(server).add(transcript);
  return h;
}

}  // namespace

Status init() {
  static std::once_flag once;
  static int result = -1;
  std::call_once(once, [] { result = sodium_init(); });
  if (result < 0) return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "libsodium could not be initialized");
  return Status::ok();
}

Result<Key> derive_secret_key(std::string_view secret) {
  if (Status s = init(); !s.is_ok()) return s;
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.remove_suffix(1);
  if (secret.size() < kSecretBytesMin) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "the secret is " + std::to_string(secret.size()) +
                                                        " bytes long; it must have at least " +
                                                        std::to_string(kSecretBytesMin));
  }
  if (secret.size() > kSecretBytesMax) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "the secret is longer than " + std::to_string(kSecretBytesMax) + " bytes");
  }
  const auto* context = reinterpret_cast<const std::uint8_t*>(kSecretContext.data());
  Hasher h(std::span<const std::uint8_t>(context, kSecretContext.size()).first(kKeyBytes), "secret");
  h.add(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(secret.data()), secret.size()));
  return h.finish();
}

Result<Key> load_secret_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "cannot read the secret file '" + path + "'");
  std::string bytes;
  bytes.resize(kSecretBytesMax + 1);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<std::size_t>(in.gcount()));
  auto key = derive_secret_key(bytes);
  if (!key.is_ok()) return Status(key.status().code(), "secret file '" + path + "': " + key.status().message());
  return key;
}

Result<std::string> load_token_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "cannot read the token file '" + path + "'");
  std::string token(kTokenBytesMax + 3, '\0');
  in.read(token.data(), static_cast<std::streamsize>(token.size()));
  token.resize(static_cast<std::size_t>(in.gcount()));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  const auto bad = [&](const std::string& why) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "token file '" + path + "': " + why);
  };
  if (token.size() < kTokenBytesMin) {
    return bad("the token is " + std::to_string(token.size()) + " bytes long; it must have at least " +
               std::to_string(kTokenBytesMin));
  }
  if (token.size() > kTokenBytesMax) return bad("the token is longer than " + std::to_string(kTokenBytesMax) + " bytes");
  for (const char c : token) {
    if (c <= ' ' || c > '~') return bad("the token may hold visible ASCII characters only (no spaces or line breaks)");
  }
  return token;
}

bool authorization_matches(std::string_view header, std::string_view token, bool allow_basic) {
  if (!init().is_ok() || token.empty()) return false;
  std::string presented;
  constexpr std::string_view kBearer = "Bearer ";
  constexpr std::string_view kBasic = "Basic ";
  if (header.substr(0, kBearer.size()) == kBearer) {
    presented = header.substr(kBearer.size());
  } else if (allow_basic && header.substr(0, kBasic.size()) == kBasic) {
    const std::string_view encoded = header.substr(kBasic.size());
    if (encoded.size() > 2 * kTokenBytesMax) return false;
    std::string decoded(encoded.size(), '\0');
    std::size_t decoded_bytes = 0;
    if (sodium_base642bin(reinterpret_cast<unsigned char*>(decoded.data()), decoded.size(), encoded.data(),
                          encoded.size(), nullptr, &decoded_bytes, nullptr, sodium_base64_VARIANT_ORIGINAL) != 0) {
      return false;
    }
    decoded.resize(decoded_bytes);
    const auto colon = decoded.find(':');
    if (colon == std::string::npos) return false;
    presented = decoded.substr(colon + 1);
  } else {
    return false;
  }
  const auto digest = [](std::string_view text) {
    std::array<std::uint8_t, crypto_generichash_BYTES> out{};
    crypto_generichash(out.data(), out.size(), reinterpret_cast<const unsigned char*>(text.data()), text.size(),
                       nullptr, 0);
    return out;
  };
  const auto a = digest(presented);
  const auto b = digest(token);
  return sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

Key random_key() {
  [[maybe_unused]] Status s = init();
  Key out{};
  randombytes_buf(out.data(), out.size());
  return out;
}

Nonce random_nonce() {
  [[maybe_unused]] Status s = init();
  Nonce out{};
  randombytes_buf(out.data(), out.size());
  return out;
}

Key pair_key(const Key& run_key, PeerId a, PeerId b) {
  if (b < a) std::swap(a, b);
  Hasher h(run_key, "lockstep pair key v1");
  h.add(a).add(b);
  return h.finish();
}

Key relay_key(const Key& pair_key) { return Hasher(pair_key, "lockstep relay key v1").finish(); }

Proof proof(const Key& key, std::string_view role, const Nonce& client, const Nonce& server,
            std::span<const std::uint8_t> transcript) {
  return handshake_hash(key, role, client, server, transcript).finish();
}

bool verify(const Key& key, std::string_view role, const Nonce& client, const Nonce& server,
            std::span<const std::uint8_t> transcript, std::span<const std::uint8_t> received) {
  if (received.size() != kProofBytes) return false;
  const Proof expected = proof(key, role, client, server, transcript);
  return sodium_memcmp(expected.data(), received.data(), kProofBytes) == 0;
}

SessionKeys session_keys(const Key& key, const Nonce& client, const Nonce& server,
                         std::span<const std::uint8_t> transcript) {
  SessionKeys out;
  out.to_server = handshake_hash(key, "lockstep session to server v1", client, server, transcript).finish();
  out.to_client = handshake_hash(key, "lockstep session to client v1", client, server, transcript).finish();
  return out;
}

bool to_nonce(std::span<const std::uint8_t> bytes, Nonce* out) {
  if (bytes.size() != kNonceBytes) return false;
  std::copy(bytes.begin(), bytes.end(), out->begin());
  return true;
}

bool to_key(std::span<const std::uint8_t> bytes, Key* out) {
  if (bytes.size() != kKeyBytes) return false;
  std::copy(bytes.begin(), bytes.end(), out->begin());
  return true;
}

std::vector<std::uint8_t> to_bytes(std::span<const std::uint8_t> bytes) { return {bytes.begin(), bytes.end()}; }

void Aead::seal(std::span<const std::uint8_t> plain, std::span<const std::uint8_t> ad, std::uint8_t* out) {
  std::uint8_t nonce[crypto_aead_chacha20poly1305_ietf_NPUBBYTES] = {};
  for (int i = 0; i < 8; ++i) nonce[i] = static_cast<std::uint8_t>(counter_ >> (8 * i));
  ++counter_;
  unsigned long long tag_bytes = 0;
  crypto_aead_chacha20poly1305_ietf_encrypt_detached(out, out + plain.size(), &tag_bytes, plain.data(), plain.size(),
                                                     ad.data(), ad.size(), nullptr, nonce, key_.data());
}

bool Aead::open(std::span<const std::uint8_t> box, std::span<const std::uint8_t> ad, std::uint8_t* plain) {
  if (box.size() < kTagBytes) return false;
  std::uint8_t nonce[crypto_aead_chacha20poly1305_ietf_NPUBBYTES] = {};
  for (int i = 0; i < 8; ++i) nonce[i] = static_cast<std::uint8_t>(counter_ >> (8 * i));
  const std::size_t n = box.size() - kTagBytes;
  if (crypto_aead_chacha20poly1305_ietf_decrypt_detached(plain, nullptr, box.data(), n, box.data() + n, ad.data(),
                                                         ad.size(), nonce, key_.data()) != 0) {
    return false;
  }
  ++counter_;
  return true;
}

}  // namespace lockstep::security
