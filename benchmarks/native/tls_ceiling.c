/* The ceiling of TLS on this machine: one TCP connection over loopback, a sender thread and a
 * receiver in one process, first as plain TCP and then as TLS 1.3 through OpenSSL (default
 * cipher suite), alternating for the given number of rounds. No Python anywhere on the path, so
 * what it prints is the most any user-space TLS transport reaches here.
 *
 * usage: tls_ceiling CERT KEY BYTES_PER_ROUND ROUNDS
 * prints one line per round: "tcp <GB/s>" or "tls <GB/s>".
 * build: cc -O2 tls_ceiling.c -o tls_ceiling -lssl -lcrypto -lpthread
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { CHUNK = 1 << 20 };

struct job {
    int listener;
    int tls;
    long total;
    SSL_CTX *server;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what) {
    fprintf(stderr, "tls_ceiling: %s\n", what);
    ERR_print_errors_fp(stderr);
    exit(1);
}

static void *send_all(void *arg) {
    struct job *job = arg;
    int fd = accept(job->listener, NULL, NULL);
    char *buf = malloc(CHUNK);
    SSL *ssl = NULL;
    if (fd < 0 || buf == NULL) die("accept");
    memset(buf, 0x5a, CHUNK);
    if (job->tls) {
        ssl = SSL_new(job->server);
        SSL_set_fd(ssl, fd);
        if (SSL_accept(ssl) <= 0) die("TLS accept");
    }
    for (long sent = 0; sent < job->total; sent += CHUNK) {
        if (ssl != NULL) {
            if (SSL_write(ssl, buf, CHUNK) != CHUNK) die("TLS write");
            continue;
        }
        for (long off = 0; off < CHUNK;) {
            long n = send(fd, buf + off, CHUNK - off, 0);
            if (n <= 0) die("send");
            off += n;
        }
    }
    if (ssl != NULL) SSL_free(ssl);
    close(fd);
    free(buf);
    return NULL;
}

static double one_round(int tls, long total, SSL_CTX *server, SSL_CTX *client) {
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {0};
    socklen_t len = sizeof addr;
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1)) die("listen");
    getsockname(listener, (struct sockaddr *)&addr, &len);
    struct job job = {listener, tls, total, server};
    pthread_t sender;
    pthread_create(&sender, NULL, send_all, &job);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) die("connect");
    SSL *ssl = NULL;
    if (tls) {
        ssl = SSL_new(client);
        SSL_set_fd(ssl, fd);
        if (SSL_connect(ssl) <= 0) die("TLS connect");
    }
    char *buf = malloc(CHUNK);
    double start = now();
    long got = 0;
    while (got < total) {
        long n = ssl != NULL ? SSL_read(ssl, buf, CHUNK) : recv(fd, buf, CHUNK, 0);
        if (n <= 0) die("read");
        got += n;
    }
    double seconds = now() - start;
    pthread_join(sender, NULL);
    if (ssl != NULL) SSL_free(ssl);
    close(fd);
    close(listener);
    free(buf);
    return total / seconds / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 5) die("usage: tls_ceiling CERT KEY BYTES_PER_ROUND ROUNDS");
    long total = atol(argv[3]);
    int rounds = atoi(argv[4]);
    SSL_CTX *server = SSL_CTX_new(TLS_server_method());
    SSL_CTX *client = SSL_CTX_new(TLS_client_method());
    if (SSL_CTX_use_certificate_chain_file(server, argv[1]) != 1) die("certificate");
    if (SSL_CTX_use_PrivateKey_file(server, argv[2], SSL_FILETYPE_PEM) != 1) die("key");
    SSL_CTX_set_min_proto_version(server, TLS1_3_VERSION);
    for (int r = 0; r < rounds; r++) {
        printf("tcp %.3f\n", one_round(0, total, server, client));
        printf("tls %.3f\n", one_round(1, total, server, client));
        fflush(stdout);
    }
    return 0;
}
